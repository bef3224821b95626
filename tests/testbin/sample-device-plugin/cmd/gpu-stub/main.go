// gpu-stub: the kubelet's own device-plugin stub (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1,
// the server the Kubernetes sample device plugin runs) serving a resource name, socket and device IDs given
// on the command line: the stand-in for another vendor's GPU device plugin in the adoption tests (NVIDIA's
// plugin registers nvidia.com/gpu on nvidia-gpu.sock with the GPU UUIDs as device IDs).
//
// It registers once with -kubelet, answers Allocate with NVIDIA_VISIBLE_DEVICES, and on SIGTERM stops and
// removes its socket, as NVIDIA's plugin does when its pod leaves the node.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	plugin "k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
)

func allocate(r *pluginapi.AllocateRequest, devs map[string]*pluginapi.Device) (*pluginapi.AllocateResponse, error) {
	out := &pluginapi.AllocateResponse{}
	for _, req := range r.ContainerRequests {
		for _, id := range req.DevicesIds {
			if _, ok := devs[id]; !ok {
				return nil, fmt.Errorf("unknown device %s", id)
			}
		}
		out.ContainerResponses = append(out.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(req.DevicesIds, ",")},
		})
	}
	return out, nil
}

func main() {
	socket := flag.String("socket", "", "socket path to serve on")
	resource := flag.String("resource", "nvidia.com/gpu", "resource name to register")
	kubelet := flag.String("kubelet", "", "the kubelet's registration socket")
	devices := flag.String("devices", "", "comma-separated device IDs")
	flag.Parse()
	if *socket == "" || *kubelet == "" || *devices == "" {
		fmt.Fprintln(os.Stderr, "gpu-stub: -socket, -kubelet and -devices are required")
		os.Exit(2)
	}
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	var devs []*pluginapi.Device
	for _, id := range strings.Split(*devices, ",") {
		devs = append(devs, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
	}
	stub := plugin.NewDevicePluginStub(devs, *socket, *resource, false, false)
	stub.SetAllocFunc(allocate)
	if err := stub.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "gpu-stub: start:", err)
		os.Exit(1)
	}
	if err := stub.Register(*kubelet, *resource, ""); err != nil {
		fmt.Fprintln(os.Stderr, "gpu-stub: register:", err)
		os.Exit(1)
	}
	fmt.Println("registered")
	<-sig
	if err := stub.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, "gpu-stub: stop:", err)
		os.Exit(1)
	}
}
