// nvml-view prints the node as NVIDIA's Go code sees it (go-nvml over libnvidia-ml.so.1, go-nvlib's
// device and MIG-profile layer on top) and changes MIG layouts through the NVML C API.
//
//	nvml-view                          JSON: GPUs, MIG profiles and placements, MIG devices
//	nvml-view mig-mode GPU on|off      nvmlDeviceSetMigMode; prints the activation status
//	nvml-view create GPU PROFILE [START]   GPU instance (at START) + one compute instance covering it
//	nvml-view destroy GPU GI_ID        destroy the GPU instance and its compute instances
//	nvml-view events TIMEOUT_MS N      register XID/ECC events on every GPU, print up to N as JSON
//	nvml-view fields GPU ID[:SCOPE]... nvmlDeviceGetFieldValues in one call; each field's own return,
//	                                   value type and value (e.g. 230: the GPU recovery action)
//
// PROFILE is a go-nvlib profile name ("1g.10gb", "2g.20gb+me"). Errors go to stderr with exit 1.
package main

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvlib/pkg/nvlib/device"
	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

type profileView struct {
	Name            string `json:"name"`
	GoNvlibName     string `json:"go_nvlib_name"`
	GiProfileID     int    `json:"gi_profile_id"`
	ID              uint32 `json:"id"`
	SliceCount      uint32 `json:"slice_count"`
	InstanceCount   uint32 `json:"instance_count"`
	MemoryMiB       uint64 `json:"memory_mib"`
	PlacementStarts []int  `json:"placement_starts"`
	PlacementSize   int    `json:"placement_size"`
}

type migView struct {
	GiID           int    `json:"gi_id"`
	CiID           int    `json:"ci_id"`
	UUID           string `json:"uuid"`
	Profile        string `json:"profile"`
	PlacementStart int    `json:"placement_start"`
	PlacementSize  int    `json:"placement_size"`
	MemoryMiB      uint64 `json:"memory_mib"`
}

type gpuView struct {
	Index          int           `json:"index"`
	UUID           string        `json:"uuid"`
	Name           string        `json:"name"`
	PciBusID       string        `json:"pci_bus_id"`
	Minor          int           `json:"minor_number"`
	MemoryMiB      uint64        `json:"memory_mib"`
	Architecture   string        `json:"architecture"`
	ComputeCap     string        `json:"compute_capability"`
	MigCapable     bool          `json:"mig_capable"`
	MigEnabled     bool          `json:"mig_enabled"`
	MigPending     bool          `json:"mig_pending"`
	Profiles       []profileView `json:"mig_profiles"`
	GoNvlibProfile []string      `json:"go_nvlib_profiles"`
	MigDevices     []migView     `json:"mig_devices"`
}

type nodeView struct {
	DriverVersion     string    `json:"driver_version"`
	CudaDriverVersion int       `json:"cuda_driver_version"`
	Gpus              []gpuView `json:"gpus"`
}

func check(ret nvml.Return, what string) {
	if ret != nvml.SUCCESS {
		fmt.Fprintf(os.Stderr, "nvml-view: %s: %v\n", what, nvml.ErrorString(ret))
		os.Exit(1)
	}
}

func fail(err error) {
	if err != nil {
		fmt.Fprintf(os.Stderr, "nvml-view: %v\n", err)
		os.Exit(1)
	}
}

func atoi(s, what string) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		fmt.Fprintf(os.Stderr, "nvml-view: %s %q is not a number\n", what, s)
		os.Exit(2)
	}
	return n
}

// giProfileNamed finds the GPU instance profile whose go-nvlib name (C == G, engine 0) is name.
func giProfileNamed(lib device.Interface, dev nvml.Device, name string) (int, nvml.GpuInstanceProfileInfo) {
	mem, ret := dev.GetMemoryInfo()
	check(ret, "memory info")
	for i := 0; i < nvml.GPU_INSTANCE_PROFILE_COUNT; i++ {
		info, ret := dev.GetGpuInstanceProfileInfo(i)
		if ret != nvml.SUCCESS {
			continue
		}
		p, err := lib.NewMigProfile(i, ciProfileFor(info.SliceCount), 0, info.MemorySizeMB, mem.Total)
		if err == nil && p.String() == name {
			return i, info
		}
	}
	fmt.Fprintf(os.Stderr, "nvml-view: MIG profile %q is not offered\n", name)
	os.Exit(1)
	return 0, nvml.GpuInstanceProfileInfo{}
}

func ciProfileFor(slices uint32) int {
	switch slices {
	case 1:
		return nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE
	case 2:
		return nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE
	case 3:
		return nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE
	case 4:
		return nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE
	case 6:
		return nvml.COMPUTE_INSTANCE_PROFILE_6_SLICE
	case 8:
		return nvml.COMPUTE_INSTANCE_PROFILE_8_SLICE
	}
	return nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE
}

func view(lib nvml.Interface, devlib device.Interface) nodeView {
	var out nodeView
	var ret nvml.Return
	out.DriverVersion, ret = lib.SystemGetDriverVersion()
	check(ret, "driver version")
	out.CudaDriverVersion, ret = lib.SystemGetCudaDriverVersion()
	check(ret, "CUDA driver version")
	out.Gpus = []gpuView{}
	err := devlib.VisitDevices(func(i int, d device.Device) error {
		g := gpuView{Index: i, Profiles: []profileView{}, GoNvlibProfile: []string{}, MigDevices: []migView{}}
		var ret nvml.Return
		g.UUID, ret = d.GetUUID()
		check(ret, "uuid")
		g.Name, ret = d.GetName()
		check(ret, "name")
		var err error
		g.PciBusID, err = d.GetPCIBusID()
		fail(err)
		minor, ret := d.GetMinorNumber()
		check(ret, "minor number")
		g.Minor = minor
		mem, ret := d.GetMemoryInfo()
		check(ret, "memory")
		g.MemoryMiB = mem.Total / (1024 * 1024)
		g.Architecture, err = d.GetArchitectureAsString()
		fail(err)
		g.ComputeCap, err = d.GetCudaComputeCapabilityAsString()
		fail(err)
		g.MigCapable, err = d.IsMigCapable()
		fail(err)
		g.MigEnabled, err = d.IsMigEnabled()
		fail(err)
		if g.MigCapable {
			_, pending, ret := d.GetMigMode()
			check(ret, "MIG mode")
			g.MigPending = pending == nvml.DEVICE_MIG_ENABLE
			for p := 0; p < nvml.GPU_INSTANCE_PROFILE_COUNT; p++ {
				info, ret := d.GetGpuInstanceProfileInfo(p)
				if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
					continue
				}
				check(ret, "GPU instance profile info")
				if info.InstanceCount == 0 {
					continue
				}
				prof, err := devlib.NewMigProfile(p, ciProfileFor(info.SliceCount), 0, info.MemorySizeMB, mem.Total)
				fail(err)
				v2 := d.GetGpuInstanceProfileInfoV(p)
				named, ret := v2.V2()
				check(ret, "GPU instance profile info v2")
				pv := profileView{
					Name: trimName(named.Name[:]), GoNvlibName: prof.String(), GiProfileID: p, ID: info.Id,
					SliceCount: info.SliceCount, InstanceCount: info.InstanceCount, MemoryMiB: info.MemorySizeMB,
					PlacementStarts: []int{},
				}
				placements, ret := d.GetGpuInstancePossiblePlacements(&info)
				check(ret, "possible placements")
				for _, pl := range placements {
					pv.PlacementStarts = append(pv.PlacementStarts, int(pl.Start))
					pv.PlacementSize = int(pl.Size)
				}
				g.Profiles = append(g.Profiles, pv)
			}
			profiles, err := d.GetMigProfiles()
			fail(err)
			seen := map[string]bool{}
			for _, p := range profiles {
				if !seen[p.String()] {
					seen[p.String()] = true
					g.GoNvlibProfile = append(g.GoNvlibProfile, p.String())
				}
			}
			sort.Strings(g.GoNvlibProfile)
		}
		if g.MigEnabled {
			err = d.VisitMigDevices(func(j int, m device.MigDevice) error {
				var mv migView
				var ret nvml.Return
				mv.UUID, ret = m.GetUUID()
				check(ret, "MIG uuid")
				mv.GiID, ret = m.GetGpuInstanceId()
				check(ret, "GPU instance id")
				mv.CiID, ret = m.GetComputeInstanceId()
				check(ret, "compute instance id")
				prof, err := m.GetProfile()
				if err != nil {
					return err
				}
				mv.Profile = prof.String()
				gi, ret := d.GetGpuInstanceById(mv.GiID)
				check(ret, "GPU instance by id")
				giInfo, ret := gi.GetInfo()
				check(ret, "GPU instance info")
				mv.PlacementStart = int(giInfo.Placement.Start)
				mv.PlacementSize = int(giInfo.Placement.Size)
				mm, ret := m.GetMemoryInfo()
				check(ret, "MIG memory")
				mv.MemoryMiB = mm.Total / (1024 * 1024)
				g.MigDevices = append(g.MigDevices, mv)
				return nil
			})
			fail(err)
			sort.Slice(g.MigDevices, func(a, b int) bool {
				x, y := g.MigDevices[a], g.MigDevices[b]
				if x.PlacementStart != y.PlacementStart {
					return x.PlacementStart < y.PlacementStart
				}
				if x.GiID != y.GiID {
					return x.GiID < y.GiID
				}
				return x.CiID < y.CiID
			})
		}
		out.Gpus = append(out.Gpus, g)
		return nil
	})
	fail(err)
	return out
}

func trimName(b []int8) string {
	n := 0
	for n < len(b) && b[n] != 0 {
		n++
	}
	out := make([]byte, n)
	for i := 0; i < n; i++ {
		out[i] = byte(b[i])
	}
	return string(out)
}

// fieldValue decodes a FieldValue's 8-byte union by its value type (little-endian, as the C union).
func fieldValue(v nvml.FieldValue) any {
	b := v.Value[:]
	switch nvml.ValueType(v.ValueType) {
	case nvml.VALUE_TYPE_DOUBLE:
		return math.Float64frombits(binary.LittleEndian.Uint64(b))
	case nvml.VALUE_TYPE_UNSIGNED_INT:
		return binary.LittleEndian.Uint32(b)
	case nvml.VALUE_TYPE_UNSIGNED_LONG, nvml.VALUE_TYPE_UNSIGNED_LONG_LONG:
		return binary.LittleEndian.Uint64(b)
	case nvml.VALUE_TYPE_SIGNED_LONG_LONG:
		return int64(binary.LittleEndian.Uint64(b))
	case nvml.VALUE_TYPE_SIGNED_INT:
		return int32(binary.LittleEndian.Uint32(b))
	case nvml.VALUE_TYPE_UNSIGNED_SHORT:
		return binary.LittleEndian.Uint16(b)
	}
	return nil
}

// fields reads the given field ids (ID or ID:SCOPE) of one GPU with a single nvmlDeviceGetFieldValues.
func fields(lib nvml.Interface, gpu int, specs []string) []map[string]any {
	dev, ret := lib.DeviceGetHandleByIndex(gpu)
	check(ret, "device handle")
	values := make([]nvml.FieldValue, len(specs))
	for i, spec := range specs {
		id, scope, _ := strings.Cut(spec, ":")
		values[i].FieldId = uint32(atoi(id, "field id"))
		if scope != "" {
			values[i].ScopeId = uint32(atoi(scope, "scope id"))
		}
	}
	check(dev.GetFieldValues(values), "field values")
	out := make([]map[string]any, len(values))
	for i, v := range values {
		out[i] = map[string]any{
			"field_id": v.FieldId, "scope_id": v.ScopeId, "nvml_return": v.NvmlReturn,
			"value_type": v.ValueType, "value": nil,
		}
		if nvml.Return(v.NvmlReturn) == nvml.SUCCESS {
			out[i]["value"] = fieldValue(v)
		}
	}
	return out
}

func printJSON(v any) {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	fail(enc.Encode(v))
}

func main() {
	lib := nvml.New()
	check(lib.Init(), "init")
	defer lib.Shutdown()
	devlib := device.New(lib)
	args := os.Args[1:]
	if len(args) == 0 {
		printJSON(view(lib, devlib))
		return
	}
	switch {
	case args[0] == "mig-mode" && len(args) == 3:
		dev, ret := lib.DeviceGetHandleByIndex(atoi(args[1], "GPU"))
		check(ret, "device handle")
		mode := nvml.DEVICE_MIG_DISABLE
		if args[2] == "on" {
			mode = nvml.DEVICE_MIG_ENABLE
		}
		status, ret := dev.SetMigMode(mode)
		check(ret, "set MIG mode")
		printJSON(map[string]any{"activation_status": int(status)})
	case args[0] == "create" && (len(args) == 3 || len(args) == 4):
		dev, ret := lib.DeviceGetHandleByIndex(atoi(args[1], "GPU"))
		check(ret, "device handle")
		_, info := giProfileNamed(devlib, dev, args[2])
		var gi nvml.GpuInstance
		if len(args) == 4 {
			placement := nvml.GpuInstancePlacement{Start: uint32(atoi(args[3], "placement start")), Size: info.SliceCount}
			placements, ret := dev.GetGpuInstancePossiblePlacements(&info)
			check(ret, "possible placements")
			if len(placements) > 0 {
				placement.Size = placements[0].Size
			}
			gi, ret = dev.CreateGpuInstanceWithPlacement(&info, &placement)
			check(ret, "create GPU instance")
		} else {
			gi, ret = dev.CreateGpuInstance(&info)
			check(ret, "create GPU instance")
		}
		ciInfo, ret := gi.GetComputeInstanceProfileInfo(ciProfileFor(info.SliceCount), nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		check(ret, "compute instance profile info")
		ci, ret := gi.CreateComputeInstance(&ciInfo)
		if ret != nvml.SUCCESS {
			gi.Destroy()
			check(ret, "create compute instance")
		}
		giInfo, ret := gi.GetInfo()
		check(ret, "GPU instance info")
		ciI, ret := ci.GetInfo()
		check(ret, "compute instance info")
		printJSON(map[string]any{"gi_id": giInfo.Id, "ci_id": ciI.Id, "placement_start": giInfo.Placement.Start})
	case args[0] == "destroy" && len(args) == 3:
		dev, ret := lib.DeviceGetHandleByIndex(atoi(args[1], "GPU"))
		check(ret, "device handle")
		gi, ret := dev.GetGpuInstanceById(atoi(args[2], "GPU instance id"))
		check(ret, "GPU instance by id")
		for p := 0; p < nvml.COMPUTE_INSTANCE_PROFILE_COUNT; p++ {
			ciInfo, ret := gi.GetComputeInstanceProfileInfo(p, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
			if ret != nvml.SUCCESS {
				continue
			}
			cis, ret := gi.GetComputeInstances(&ciInfo)
			if ret != nvml.SUCCESS {
				continue
			}
			for _, ci := range cis {
				check(ci.Destroy(), "destroy compute instance")
			}
		}
		check(gi.Destroy(), "destroy GPU instance")
		printJSON(map[string]any{"destroyed": atoi(args[2], "GPU instance id")})
	case args[0] == "events" && len(args) == 3:
		set, ret := lib.EventSetCreate()
		check(ret, "event set")
		defer set.Free()
		count, ret := lib.DeviceGetCount()
		check(ret, "device count")
		handles := map[string]int{}
		for i := 0; i < count; i++ {
			dev, ret := lib.DeviceGetHandleByIndex(i)
			check(ret, "device handle")
			uuid, ret := dev.GetUUID()
			check(ret, "uuid")
			handles[uuid] = i
			check(dev.RegisterEvents(nvml.EventTypeXidCriticalError|nvml.EventTypeDoubleBitEccError|nvml.EventTypeSingleBitEccError, set), "register events")
		}
		timeout := uint32(atoi(args[1], "timeout"))
		want := atoi(args[2], "event count")
		events := []map[string]any{}
		for len(events) < want {
			data, ret := set.Wait(timeout)
			if ret == nvml.ERROR_TIMEOUT {
				break
			}
			check(ret, "event wait")
			uuid, ret := data.Device.GetUUID()
			check(ret, "event device uuid")
			events = append(events, map[string]any{
				"gpu": handles[uuid], "event_type": data.EventType, "event_data": data.EventData,
				"gpu_instance_id": data.GpuInstanceId, "compute_instance_id": data.ComputeInstanceId,
			})
		}
		printJSON(events)
	case args[0] == "fields" && len(args) >= 3:
		printJSON(fields(lib, atoi(args[1], "GPU"), args[2:]))
	default:
		fmt.Fprintf(os.Stderr, "nvml-view: unknown command %q (see the comment at the top of main.go)\n", args)
		os.Exit(2)
	}
}
