// The kubelet's PodResources v1 server (pkg/kubelet/apis/podresources) on a Unix socket, answering from
// what this harness holds: the pods it prepared (until they are unprepared) and, per container, the
// ResourceClaims the DRA manager prepared for them. The methods whose signatures differ between releases
// are in podresources_k8s*.go.
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sort"

	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/apis/podresources"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra/state"
)

// The feature gates the PodResources server reads: List reports the claims of each container
// (KubeletPodResourcesDynamicResources) and walks the active pods, not every pod the kubelet knows
// (KubeletPodResourcesListUseActivePods). Both are on by default in 1.34 and later; set here so the
// harness does not depend on the defaults.
const podResourcesGates = "KubeletPodResourcesDynamicResources=true,KubeletPodResourcesListUseActivePods=true"

// podResourcesSource answers the server's providers. Devices, CPUs and memory come from the kubelet's
// device, CPU and memory managers, which this harness does not run: those answers are empty.
type podResourcesSource struct {
	h *harness
}

// servePodResources listens on socket (mode 0600, replacing a stale socket file) and serves until ctx
// ends. The socket is bound under a temporary name, restricted, then renamed into place, so no client
// ever finds it with wider permissions.
func servePodResources(ctx context.Context, h *harness, socket string) error {
	if err := os.MkdirAll(filepath.Dir(socket), 0o750); err != nil {
		return err
	}
	tmp := filepath.Join(filepath.Dir(socket), fmt.Sprintf(".%s.%d", filepath.Base(socket), os.Getpid()))
	_ = os.Remove(tmp)
	lis, err := net.Listen("unix", tmp)
	if err != nil {
		return err
	}
	// the listener must not unlink the path it was bound to (that name is gone after the rename)
	lis.(*net.UnixListener).SetUnlinkOnClose(false)
	if err := os.Chmod(tmp, 0o600); err != nil {
		_ = lis.Close()
		return err
	}
	if err := os.Rename(tmp, socket); err != nil {
		_ = lis.Close()
		return err
	}
	src := podResourcesSource{h: h}
	server := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(server, podresources.NewV1PodResourcesServer(ctx,
		podresources.PodResourcesProviders{Pods: src, Devices: src, Cpus: src, Memory: src, DynamicResources: src}))
	go func() {
		<-ctx.Done()
		server.Stop()
		_ = os.Remove(socket)
	}()
	go func() {
		if err := server.Serve(lis); err != nil {
			klog.Background().Error(err, "PodResources server stopped")
		}
	}()
	return nil
}

// GetActivePods: the pods prepared and not yet unprepared (the kubelet's active pods are its admitted,
// not terminated pods), in namespace/name order.
func (s podResourcesSource) GetActivePods() []*v1.Pod {
	pods := s.h.activePods()
	sort.Slice(pods, func(i, j int) bool {
		if pods[i].Namespace != pods[j].Namespace {
			return pods[i].Namespace < pods[j].Namespace
		}
		return pods[i].Name < pods[j].Name
	})
	return pods
}

// GetPods: the harness keeps no terminated pods, so every pod it knows is active.
func (s podResourcesSource) GetPods() []*v1.Pod {
	return s.GetActivePods()
}

func (s podResourcesSource) GetPodByName(namespace, name string) (*v1.Pod, bool) {
	for _, p := range s.h.activePods() {
		if p.Namespace == namespace && p.Name == name {
			return p, true
		}
	}
	return nil, false
}

// dynamicResources is what the kubelet's container manager answers for one container: every claim the
// DRA manager holds for it, with each prepared device as (driver, pool, device, CDI IDs). As in the
// kubelet, the CDI ID list is collected per driver of a claim, so a device's entry also carries the IDs
// of the same driver's devices listed before it. A claim-info lookup that fails answers no claims (the
// kubelet logs it and does the same).
func (h *harness) dynamicResources(logger klog.Logger, pod *v1.Pod, ctr *v1.Container) []*podresourcesv1.DynamicResource {
	infos, err := h.manager.GetContainerClaimInfos(pod, ctr)
	if err != nil {
		logger.Error(err, "PodResources: claim infos of a container", "pod", klog.KObj(pod), "container", ctr.Name)
		return []*podresourcesv1.DynamicResource{}
	}
	var out []*podresourcesv1.DynamicResource
	for _, info := range infos {
		res := &podresourcesv1.DynamicResource{ClaimName: info.ClaimName, ClaimNamespace: info.Namespace}
		for driver, ds := range info.DriverState {
			var ids []*podresourcesv1.CDIDevice
			for i := range ds.Devices {
				for _, id := range ds.Devices[i].CDIDeviceIDs {
					ids = append(ids, &podresourcesv1.CDIDevice{Name: id})
				}
				res.ClaimResources = append(res.ClaimResources, claimResource(driver, &ds.Devices[i], ids))
			}
		}
		out = append(out, res)
	}
	return out
}

// claimResourceFields fills the fields every release has.
func claimResourceFields(driver string, d *state.Device, cdi []*podresourcesv1.CDIDevice) *podresourcesv1.ClaimResource {
	return &podresourcesv1.ClaimResource{CdiDevices: cdi, DriverName: driver, PoolName: d.PoolName, DeviceName: d.DeviceName}
}
