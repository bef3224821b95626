// Command kubelet-harness runs the kubelet's own device manager (devicemanager.ManagerImpl from the
// pinned k8s.io/kubernetes release) outside a kubelet, so tests can drive real device-plugin traffic.
//
// The manager only listens on the fixed kubelet path /var/lib/kubelet/device-plugins/kubelet.sock, so
// the harness re-executes itself in a private mount namespace (needs root), hides /var/lib behind a
// tmpfs there and bind-mounts the directory given with --dir onto that path. Plugins outside the
// namespace use --dir; the manager inside sees the same directory at the kubelet path.
//
// Commands arrive as JSON lines on stdin and every command gets exactly one JSON line on stdout:
//
//	{"cmd": "list"}
//	{"cmd": "allocate", "resource": R, "count": N, "pod": P, "namespace": NS, "pod_uid": U, "container": C}
//	{"cmd": "release", "pod_uid": U}
//	{"cmd": "restart"}
//	{"cmd": "wait", "resource": R, "device": ID, "health": H, "count": N, "healthy": N, "registered": B,
//	 "timeout": SECONDS}
//	{"cmd": "updates", "resource": R, "since": SEQ}
//	{"cmd": "plugin", "socket": NAME, "method": M, "devices": [...], "available": [...],
//	 "must_include": [...], "size": N}
//	{"cmd": "pod_health", "pod_uid": U}
//	{"cmd": "quit"}
//
// The kubelet's ResourceHealthStatus feature gate is on: "pod_health" answers what the manager's
// UpdateAllocatedResourcesStatus writes into the pod's container statuses (allocatedResourcesStatus: per
// container, per resource, each allocated device Healthy/Unhealthy), plus how many times the manager asked
// (on its Updates channel, as it asks the kubelet) for that pod's status to be synced after a health change.
//
// Answers carry "ok"; failures carry "error" and, for gRPC failures of the plugin, "code" (the gRPC
// status code name) and "message". See tests/peers/harness.py for the typed Python client.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"reflect"
	"regexp"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/config"
)

const (
	nsEnv        = "NODEAGENT_HARNESS_IN_NAMESPACE"
	kubeletDir   = "/var/lib/kubelet/device-plugins"
	pollInterval = 2 * time.Millisecond
)

func main() {
	dir := flag.String("dir", "", "device-plugin directory (the kubelet.sock appears here)")
	podResources := flag.String("pod-resources-socket", "", "serve the kubelet PodResources v1 API on this socket")
	verbosity := flag.String("v", "0", "klog verbosity of the kubelet code (logs go to stderr)")
	flag.Parse()
	if *dir == "" || !filepath.IsAbs(*dir) {
		fatal("--dir must be an absolute path")
	}
	if os.Getenv(nsEnv) != "1" {
		os.Exit(reexecInNamespace())
	}
	klogFlags := flag.NewFlagSet("klog", flag.ExitOnError)
	klog.InitFlags(klogFlags)
	_ = klogFlags.Set("v", *verbosity)
	_ = klogFlags.Set("logtostderr", "true")

	if err := mountKubeletDir(*dir); err != nil {
		fatal(err.Error())
	}
	if err := utilfeature.DefaultMutableFeatureGate.Set("ResourceHealthStatus=true"); err != nil {
		fatal("enabling the ResourceHealthStatus feature gate: " + err.Error())
	}
	h := newHarness(*dir)
	if err := h.startManager(); err != nil {
		fatal("starting the device manager: " + err.Error())
	}
	if *podResources != "" {
		if err := h.servePodResources(*podResources); err != nil {
			fatal("serving PodResources: " + err.Error())
		}
	}
	go h.poll()
	h.serve(os.Stdin, os.Stdout)
	h.shutdown()
}

func fatal(msg string) {
	fmt.Fprintln(os.Stderr, "kubelet-harness:", msg)
	os.Exit(2)
}

// reexecInNamespace runs this program again in a new mount namespace and relays its exit code.
func reexecInNamespace() int {
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Env = append(os.Environ(), nsEnv+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "kubelet-harness: cannot create a mount namespace (needs root):", err)
		return 2
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()
	if err := cmd.Wait(); err != nil {
		var exitErr *exec.ExitError
		if errors.As(err, &exitErr) {
			return exitErr.ExitCode()
		}
		return 2
	}
	return 0
}

// mountKubeletDir makes dir visible at the kubelet's device-plugin path inside this mount namespace.
func mountKubeletDir(dir string) error {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return err
	}
	src, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer src.Close()
	if err := syscall.Mount("", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("making mounts private: %w", err)
	}
	if err := syscall.Mount("tmpfs", "/var/lib", "tmpfs", 0, "mode=0755"); err != nil {
		return fmt.Errorf("mounting tmpfs on /var/lib: %w", err)
	}
	if err := os.MkdirAll(kubeletDir, 0o750); err != nil {
		return err
	}
	source := fmt.Sprintf("/proc/self/fd/%d", src.Fd())
	if err := syscall.Mount(source, kubeletDir, "", syscall.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind-mounting %s on %s: %w", dir, kubeletDir, err)
	}
	return nil
}

// deviceState is one device as the manager last saw it.
type deviceState struct {
	ID       string  `json:"id"`
	Health   string  `json:"health"`
	Reported string  `json:"reported"`
	NUMA     []int64 `json:"numa"`
}

// resourceState is one resource in the manager: the plugin's device list plus the kubelet's counts.
type resourceState struct {
	Devices     []deviceState `json:"devices"`
	Capacity    int64         `json:"capacity"`
	Allocatable int64         `json:"allocatable"`
	Registered  bool          `json:"registered"`
}

// update is one observed change of a resource's state.
type update struct {
	Seq      int           `json:"seq"`
	Time     float64       `json:"time"`
	Resource string        `json:"resource"`
	State    resourceState `json:"state"`
}

type podEntry struct {
	pod *v1.Pod
}

type harness struct {
	dir string

	mu      sync.Mutex
	changed *sync.Cond
	manager *devicemanager.ManagerImpl
	pods    map[string]*podEntry
	state   map[string]resourceState
	updates []update
	stopped bool
	// pod UID → how many health updates the manager sent for it on its Updates channel
	healthUpdates map[string]int
}

func newHarness(dir string) *harness {
	h := &harness{dir: dir, pods: map[string]*podEntry{}, state: map[string]resourceState{},
		healthUpdates: map[string]int{}}
	h.changed = sync.NewCond(&h.mu)
	return h
}

func (h *harness) activePods() []*v1.Pod {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]*v1.Pod, 0, len(h.pods))
	for _, p := range h.pods {
		out = append(out, p.pod)
	}
	return out
}

func (h *harness) currentManager() *devicemanager.ManagerImpl {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.manager
}

// startManager creates a fresh ManagerImpl and starts it the way the kubelet does at boot: it reads its
// checkpoint and its registration server removes every socket in the directory.
func (h *harness) startManager() error {
	m, err := devicemanager.NewManagerImpl(nil, topologymanager.NewFakeManager())
	if err != nil {
		return err
	}
	if _, err := internalsOf(m); err != nil {
		return err
	}
	ready := config.NewSourcesReady(func(sets.Set[string]) bool { return true })
	if err := m.Start(h.activePods, ready, containermap.NewContainerMap(), sets.New[string]()); err != nil {
		return err
	}
	h.mu.Lock()
	h.manager = m
	h.mu.Unlock()
	go h.drainHealthUpdates(m)
	return nil
}

// drainHealthUpdates reads the manager's Updates channel the way the kubelet's sync loop does (a full
// channel drops updates), counting the pods it names. It ends when the manager is replaced or stopped.
func (h *harness) drainHealthUpdates(m *devicemanager.ManagerImpl) {
	for {
		select {
		case u, ok := <-m.Updates():
			if !ok {
				return
			}
			h.mu.Lock()
			for _, uid := range u.PodUIDs {
				h.healthUpdates[uid]++
			}
			h.changed.Broadcast()
			h.mu.Unlock()
		case <-time.After(100 * time.Millisecond):
			if h.currentManager() != m {
				return
			}
		}
	}
}

// podHealth builds the pod's status as the kubelet does before generating it (one container status per
// container of the spec) and lets the manager fill in allocatedResourcesStatus.
func (h *harness) podHealth(req *request) reply {
	h.mu.Lock()
	entry, ok := h.pods[req.PodUID]
	var pod *v1.Pod
	if ok {
		pod = entry.pod.DeepCopy()
	}
	updates := h.healthUpdates[req.PodUID]
	m := h.manager
	h.mu.Unlock()
	if !ok {
		return reply{"ok": false, "error": fmt.Sprintf("no pod with uid %q", req.PodUID)}
	}
	podStatus := &v1.PodStatus{}
	for _, c := range pod.Spec.Containers {
		podStatus.ContainerStatuses = append(podStatus.ContainerStatuses, v1.ContainerStatus{Name: c.Name})
	}
	m.UpdateAllocatedResourcesStatus(pod, podStatus)
	containers := map[string]any{}
	for _, cs := range podStatus.ContainerStatuses {
		resources := map[string]map[string]string{}
		for _, rs := range cs.AllocatedResourcesStatus {
			devices := map[string]string{}
			for _, r := range rs.Resources {
				devices[string(r.ResourceID)] = string(r.Health)
			}
			resources[string(rs.Name)] = devices
		}
		containers[cs.Name] = resources
	}
	return reply{"ok": true, "containers": containers, "updates": updates}
}

func (h *harness) shutdown() {
	h.mu.Lock()
	h.stopped = true
	m := h.manager
	h.mu.Unlock()
	if m != nil {
		_ = m.Stop()
	}
}

// managerInternals reads the manager's unexported device tables (allDevices, healthyDevices) under its
// own mutex. The exported GetAllocatableDevices drops unhealthy devices, and tests need them.
type managerInternals struct {
	mu      *sync.Mutex
	all     *devicemanager.ResourceDeviceInstances
	healthy *map[string]sets.Set[string]
}

func internalsOf(m *devicemanager.ManagerImpl) (managerInternals, error) {
	v := reflect.ValueOf(m).Elem()
	field := func(name string, t reflect.Type) (unsafe.Pointer, error) {
		f := v.FieldByName(name)
		if !f.IsValid() || f.Type() != t {
			return nil, fmt.Errorf("devicemanager.ManagerImpl has no field %s of type %v (kubernetes version changed?)", name, t)
		}
		return unsafe.Pointer(f.UnsafeAddr()), nil
	}
	mu, err := field("mutex", reflect.TypeOf(sync.Mutex{}))
	if err != nil {
		return managerInternals{}, err
	}
	all, err := field("allDevices", reflect.TypeOf(devicemanager.ResourceDeviceInstances{}))
	if err != nil {
		return managerInternals{}, err
	}
	healthy, err := field("healthyDevices", reflect.TypeOf(map[string]sets.Set[string]{}))
	if err != nil {
		return managerInternals{}, err
	}
	return managerInternals{
		mu: (*sync.Mutex)(mu), all: (*devicemanager.ResourceDeviceInstances)(all),
		healthy: (*map[string]sets.Set[string])(healthy),
	}, nil
}

// snapshot reads the manager's view of every resource. A device's health is the kubelet's: Healthy only
// while it is in the manager's healthy set (a disconnected plugin's devices turn Unhealthy).
func snapshot(m *devicemanager.ManagerImpl) map[string]resourceState {
	capacity, allocatable, _ := m.GetCapacity()
	in, err := internalsOf(m)
	if err != nil {
		panic(err)
	}
	in.mu.Lock()
	out := map[string]resourceState{}
	for name, devs := range *in.all {
		healthySet := (*in.healthy)[name]
		rs := resourceState{Devices: []deviceState{}}
		for id, d := range devs {
			health := pluginapi.Unhealthy
			if healthySet.Has(id) {
				health = pluginapi.Healthy
			}
			ds := deviceState{ID: id, Health: health, Reported: d.Health, NUMA: []int64{}}
			if d.Topology != nil {
				for _, n := range d.Topology.Nodes {
					ds.NUMA = append(ds.NUMA, n.ID)
				}
			}
			rs.Devices = append(rs.Devices, ds)
		}
		sort.Slice(rs.Devices, func(i, j int) bool { return rs.Devices[i].ID < rs.Devices[j].ID })
		out[name] = rs
	}
	in.mu.Unlock()
	for name, q := range capacity {
		rs := out[string(name)]
		if rs.Devices == nil {
			rs.Devices = []deviceState{}
		}
		a := allocatable[name]
		rs.Registered, rs.Capacity, rs.Allocatable = true, q.Value(), a.Value()
		out[string(name)] = rs
	}
	return out
}

func sameState(a, b resourceState) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// poll records every change of the manager's state with the time it was seen.
func (h *harness) poll() {
	for {
		m := h.currentManager()
		snap := snapshot(m)
		now := float64(time.Now().UnixNano()) / 1e9
		h.mu.Lock()
		if h.stopped {
			h.mu.Unlock()
			return
		}
		changed := false
		for name, rs := range snap {
			if old, ok := h.state[name]; !ok || !sameState(old, rs) {
				h.updates = append(h.updates, update{Seq: len(h.updates) + 1, Time: now, Resource: name, State: rs})
				changed = true
			}
		}
		for name := range h.state {
			if _, ok := snap[name]; !ok {
				gone := resourceState{Devices: []deviceState{}}
				h.updates = append(h.updates, update{Seq: len(h.updates) + 1, Time: now, Resource: name, State: gone})
				changed = true
			}
		}
		h.state = snap
		if changed {
			h.changed.Broadcast()
		}
		h.mu.Unlock()
		time.Sleep(pollInterval)
	}
}

// request is the union of all command fields.
type request struct {
	ID          any      `json:"id,omitempty"`
	Cmd         string   `json:"cmd"`
	Resource    string   `json:"resource"`
	Count       int      `json:"count"`
	Pod         string   `json:"pod"`
	Namespace   string   `json:"namespace"`
	PodUID      string   `json:"pod_uid"`
	Container   string   `json:"container"`
	Device      string   `json:"device"`
	Health      string   `json:"health"`
	Healthy     *int     `json:"healthy"`
	Total       *int     `json:"total"`
	Registered  *bool    `json:"registered"`
	Timeout     float64  `json:"timeout"`
	Since       int      `json:"since"`
	Socket      string   `json:"socket"`
	Method      string   `json:"method"`
	Devices     []string `json:"devices"`
	Available   []string `json:"available"`
	MustInclude []string `json:"must_include"`
	Size        int32    `json:"size"`
}

type reply map[string]any

func (h *harness) serve(in *os.File, out *os.File) {
	scanner := bufio.NewScanner(in)
	scanner.Buffer(make([]byte, 1<<20), 16<<20)
	enc := json.NewEncoder(out)
	for scanner.Scan() {
		line := strings.TrimSpace(scanner.Text())
		if line == "" {
			continue
		}
		var req request
		var resp reply
		if err := json.Unmarshal([]byte(line), &req); err != nil {
			resp = reply{"ok": false, "error": "bad command line: " + err.Error()}
		} else {
			resp = h.handle(&req)
			if req.ID != nil {
				resp["id"] = req.ID
			}
		}
		if err := enc.Encode(resp); err != nil {
			return
		}
		if req.Cmd == "quit" {
			return
		}
	}
}

var rpcErrorPattern = regexp.MustCompile(`rpc error: code = (\w+) desc = (.*)$`)

// failure turns an error into an answer, keeping the plugin's gRPC code and message when there is one.
func failure(err error) reply {
	r := reply{"ok": false, "error": err.Error()}
	if st, ok := status.FromError(err); ok && st.Code().String() != "Unknown" || ok && strings.HasPrefix(err.Error(), "rpc error") {
		r["code"] = st.Code().String()
		r["message"] = st.Message()
		return r
	}
	if m := rpcErrorPattern.FindStringSubmatch(err.Error()); m != nil {
		r["code"] = m[1]
		r["message"] = m[2]
	}
	return r
}

func (h *harness) handle(req *request) reply {
	switch req.Cmd {
	case "list":
		return h.list()
	case "allocate":
		return h.allocate(req)
	case "release":
		return h.release(req)
	case "restart":
		return h.restart()
	case "wait":
		return h.wait(req)
	case "updates":
		return h.listUpdates(req)
	case "plugin":
		return h.pluginCall(req)
	case "pod_health":
		return h.podHealth(req)
	case "quit":
		return reply{"ok": true}
	default:
		return reply{"ok": false, "error": fmt.Sprintf("unknown command %q", req.Cmd)}
	}
}

func (h *harness) list() reply {
	snap := snapshot(h.currentManager())
	return reply{"ok": true, "resources": snap}
}

// allocate admits a pod container asking for Count devices of Resource and runs the kubelet's
// allocation (GetPreferredAllocation when offered, then Allocate) and container-start path
// (PreStartContainer when required), returning what the container runtime would be given.
func (h *harness) allocate(req *request) reply {
	if req.Resource == "" || req.Count <= 0 {
		return reply{"ok": false, "error": "allocate needs resource and a positive count"}
	}
	ns := req.Namespace
	if ns == "" {
		ns = "default"
	}
	podName := req.Pod
	if podName == "" {
		podName = "pod"
	}
	uid := req.PodUID
	if uid == "" {
		uid = ns + "/" + podName
	}
	cname := req.Container
	if cname == "" {
		cname = "main"
	}
	container := v1.Container{
		Name: cname,
		Resources: v1.ResourceRequirements{
			Limits:   v1.ResourceList{v1.ResourceName(req.Resource): *resource.NewQuantity(int64(req.Count), resource.DecimalSI)},
			Requests: v1.ResourceList{v1.ResourceName(req.Resource): *resource.NewQuantity(int64(req.Count), resource.DecimalSI)},
		},
	}
	h.mu.Lock()
	entry, ok := h.pods[uid]
	if !ok {
		entry = &podEntry{pod: &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: podName, Namespace: ns, UID: types.UID(uid)},
		}}
		h.pods[uid] = entry
	}
	replaced := false
	for i := range entry.pod.Spec.Containers {
		if entry.pod.Spec.Containers[i].Name == cname {
			entry.pod.Spec.Containers[i] = container
			replaced = true
		}
	}
	if !replaced {
		entry.pod.Spec.Containers = append(entry.pod.Spec.Containers, container)
	}
	pod := entry.pod
	m := h.manager
	h.mu.Unlock()

	if err := m.Allocate(pod, &container); err != nil {
		return failure(err)
	}
	opts, err := m.GetDeviceRunContainerOptions(pod, &container)
	if err != nil {
		return failure(err)
	}
	ids := []string{}
	for _, devs := range m.GetDevices(uid, cname) {
		for id := range devs {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	envs := map[string]string{}
	annotations := map[string]string{}
	mounts := []map[string]any{}
	devices := []map[string]any{}
	cdi := []string{}
	if opts != nil {
		for _, e := range opts.Envs {
			envs[e.Name] = e.Value
		}
		for _, a := range opts.Annotations {
			annotations[a.Name] = a.Value
		}
		for _, mt := range opts.Mounts {
			mounts = append(mounts, map[string]any{"container_path": mt.ContainerPath, "host_path": mt.HostPath, "read_only": mt.ReadOnly})
		}
		for _, d := range opts.Devices {
			devices = append(devices, map[string]any{"container_path": d.PathInContainer, "host_path": d.PathOnHost, "permissions": d.Permissions})
		}
		for _, c := range opts.CDIDevices {
			cdi = append(cdi, c.Name)
		}
	}
	return reply{
		"ok": true, "pod_uid": uid, "container": cname, "device_ids": ids, "envs": envs, "mounts": mounts,
		"devices": devices, "annotations": annotations, "cdi_devices": cdi,
	}
}

// release deletes a pod; the manager frees its devices the way the kubelet garbage-collects them.
func (h *harness) release(req *request) reply {
	h.mu.Lock()
	_, ok := h.pods[req.PodUID]
	delete(h.pods, req.PodUID)
	m := h.manager
	h.mu.Unlock()
	if !ok {
		return reply{"ok": false, "error": fmt.Sprintf("no pod with uid %q", req.PodUID)}
	}
	m.UpdateAllocatedDevices()
	return reply{"ok": true}
}

// restart stops the manager and starts a new one, as a kubelet restart does.
func (h *harness) restart() reply {
	m := h.currentManager()
	if err := m.Stop(); err != nil {
		return failure(err)
	}
	if err := h.startManager(); err != nil {
		return failure(err)
	}
	return reply{"ok": true}
}

func (req *request) matches(rs resourceState, present bool) bool {
	if req.Registered != nil && *req.Registered != (present && rs.Registered) {
		return false
	}
	if !present {
		return req.Registered != nil && !*req.Registered && req.Device == "" && req.Total == nil && req.Healthy == nil
	}
	if req.Device != "" {
		found := false
		for _, d := range rs.Devices {
			if d.ID == req.Device {
				found = true
				if req.Health != "" && d.Health != req.Health {
					return false
				}
			}
		}
		if !found {
			return false
		}
	}
	if req.Total != nil && len(rs.Devices) != *req.Total {
		return false
	}
	if req.Healthy != nil && rs.Allocatable != int64(*req.Healthy) {
		return false
	}
	return true
}

// wait blocks until the resource's state matches the request (or the timeout passes) and reports the
// time the matching state was first seen.
func (h *harness) wait(req *request) reply {
	if req.Resource == "" {
		return reply{"ok": false, "error": "wait needs resource"}
	}
	timeout := req.Timeout
	if timeout <= 0 {
		timeout = 10
	}
	deadline := time.Now().Add(time.Duration(timeout * float64(time.Second)))
	timer := time.AfterFunc(time.Until(deadline), func() {
		h.mu.Lock()
		h.changed.Broadcast()
		h.mu.Unlock()
	})
	defer timer.Stop()
	h.mu.Lock()
	defer h.mu.Unlock()
	for {
		rs, present := h.state[req.Resource]
		if req.matches(rs, present) {
			// The earliest update since which the condition has held without a break.
			seen := float64(time.Now().UnixNano()) / 1e9
			for i := len(h.updates) - 1; i >= 0; i-- {
				u := h.updates[i]
				if u.Resource != req.Resource {
					continue
				}
				if !req.matches(u.State, u.State.Registered || len(u.State.Devices) > 0) {
					break
				}
				seen = u.Time
			}
			return reply{"ok": true, "time": seen, "state": rs}
		}
		if !time.Now().Before(deadline) {
			return reply{"ok": false, "error": fmt.Sprintf("timed out after %gs waiting for %s", timeout, req.Resource), "state": rs}
		}
		h.changed.Wait()
	}
}

func (h *harness) listUpdates(req *request) reply {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := []update{}
	for _, u := range h.updates {
		if u.Seq > req.Since && (req.Resource == "" || u.Resource == req.Resource) {
			out = append(out, u)
		}
	}
	return reply{"ok": true, "updates": out}
}

// pluginCall calls one DevicePlugin method directly with explicit arguments (bypassing the manager's
// choice of devices), using the kubelet's generated client.
func (h *harness) pluginCall(req *request) reply {
	if req.Socket == "" {
		return reply{"ok": false, "error": "plugin needs socket (file name in the plugin directory)"}
	}
	path := req.Socket
	if !filepath.IsAbs(path) {
		path = filepath.Join(kubeletDir, path)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		}))
	if err != nil {
		return failure(err)
	}
	defer conn.Close()
	client := pluginapi.NewDevicePluginClient(conn)
	var out any
	switch req.Method {
	case "GetDevicePluginOptions":
		out, err = client.GetDevicePluginOptions(ctx, &pluginapi.Empty{})
	case "Allocate":
		out, err = client.Allocate(ctx, &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: req.Devices}}})
	case "GetPreferredAllocation":
		out, err = client.GetPreferredAllocation(ctx, &pluginapi.PreferredAllocationRequest{ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
			AvailableDeviceIDs: req.Available, MustIncludeDeviceIDs: req.MustInclude, AllocationSize: req.Size,
		}}})
	case "PreStartContainer":
		out, err = client.PreStartContainer(ctx, &pluginapi.PreStartContainerRequest{DevicesIds: req.Devices})
	default:
		return reply{"ok": false, "error": fmt.Sprintf("unknown plugin method %q", req.Method)}
	}
	if err != nil {
		return failure(err)
	}
	return reply{"ok": true, "response": out}
}

// Providers for the kubelet's PodResources v1 server, fed from the harness's pods and the manager.

type podsProvider struct{ h *harness }

func (p podsProvider) GetActivePods() []*v1.Pod { return p.h.activePods() }
func (p podsProvider) GetPods() []*v1.Pod       { return p.h.activePods() }
func (p podsProvider) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, pod := range p.h.activePods() {
		if pod.Namespace == namespace && pod.Name == name {
			return pod, true
		}
	}
	return nil, false
}

type devicesProvider struct{ h *harness }

func containerDevices(rdi devicemanager.ResourceDeviceInstances) []*podresourcesv1.ContainerDevices {
	var out []*podresourcesv1.ContainerDevices
	names := make([]string, 0, len(rdi))
	for name := range rdi {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		ids := make([]string, 0, len(rdi[name]))
		for id := range rdi[name] {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		for _, id := range ids {
			cd := &podresourcesv1.ContainerDevices{ResourceName: name, DeviceIds: []string{id}}
			if topo := rdi[name][id].Topology; topo != nil && len(topo.Nodes) > 0 {
				cd.Topology = &podresourcesv1.TopologyInfo{}
				for _, n := range topo.Nodes {
					cd.Topology.Nodes = append(cd.Topology.Nodes, &podresourcesv1.NUMANode{ID: n.ID})
				}
			}
			out = append(out, cd)
		}
	}
	return out
}

func (d devicesProvider) UpdateAllocatedDevices() { d.h.currentManager().UpdateAllocatedDevices() }
func (d devicesProvider) GetDevices(podUID, containerName string) []*podresourcesv1.ContainerDevices {
	return containerDevices(d.h.currentManager().GetDevices(podUID, containerName))
}
func (d devicesProvider) GetAllocatableDevices() []*podresourcesv1.ContainerDevices {
	return containerDevices(d.h.currentManager().GetAllocatableDevices())
}

type noCPUs struct{}

func (noCPUs) GetCPUs(string, string) []int64 { return nil }
func (noCPUs) GetAllocatableCPUs() []int64    { return nil }

type noMemory struct{}

func (noMemory) GetMemory(string, string) []*podresourcesv1.ContainerMemory { return nil }
func (noMemory) GetAllocatableMemory() []*podresourcesv1.ContainerMemory    { return nil }

type noDynamic struct{}

func (noDynamic) GetDynamicResources(*v1.Pod, *v1.Container) []*podresourcesv1.DynamicResource {
	return nil
}

func (h *harness) servePodResources(path string) error {
	_ = os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		return err
	}
	srv := grpc.NewServer()
	providers := podresources.PodResourcesProviders{
		Pods: podsProvider{h}, Devices: devicesProvider{h}, Cpus: noCPUs{}, Memory: noMemory{}, DynamicResources: noDynamic{},
	}
	podresourcesv1.RegisterPodResourcesListerServer(srv, podresources.NewV1PodResourcesServer(context.Background(), providers))
	go func() { _ = srv.Serve(ln) }()
	return nil
}
