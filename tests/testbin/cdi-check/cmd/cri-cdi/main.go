// Command cri-cdi creates one container through a running containerd's CRI service, the way the kubelet
// does, asking for CDI devices with the CreateContainer request's CDIDevices field and/or a container
// annotation, and prints the OCI runtime spec containerd generated (ContainerStatus, verbose) as JSON.
// The pod sandbox uses the host network (no CNI needed); everything is removed before it exits.
//
//	cri-cdi -address SOCK -image REF [-cdi name,name] [-annotation KEY=VALUE ...]
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtime "k8s.io/cri-api/pkg/apis/runtime/v1"
)

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, " ") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

type output struct {
	RuntimeSpec json.RawMessage `json:"runtime_spec"`
}

func run(address, image string, cdi []string, annotations map[string]string) error {
	conn, err := grpc.NewClient("unix://"+address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	rt := runtime.NewRuntimeServiceClient(conn)

	uid := fmt.Sprintf("cdi-%d", time.Now().UnixNano())
	sandboxConfig := &runtime.PodSandboxConfig{
		Metadata: &runtime.PodSandboxMetadata{Name: "cdi-test", Uid: uid, Namespace: "default"},
		Linux: &runtime.LinuxPodSandboxConfig{
			SecurityContext: &runtime.LinuxSandboxSecurityContext{
				NamespaceOptions: &runtime.NamespaceOption{Network: runtime.NamespaceMode_NODE},
			},
		},
	}
	sb, err := rt.RunPodSandbox(ctx, &runtime.RunPodSandboxRequest{Config: sandboxConfig})
	if err != nil {
		return fmt.Errorf("RunPodSandbox: %w", err)
	}
	defer func() {
		c, cl := context.WithTimeout(context.Background(), 30*time.Second)
		defer cl()
		_, _ = rt.StopPodSandbox(c, &runtime.StopPodSandboxRequest{PodSandboxId: sb.PodSandboxId})
		_, _ = rt.RemovePodSandbox(c, &runtime.RemovePodSandboxRequest{PodSandboxId: sb.PodSandboxId})
	}()

	devices := []*runtime.CDIDevice{}
	for _, n := range cdi {
		devices = append(devices, &runtime.CDIDevice{Name: n})
	}
	created, err := rt.CreateContainer(ctx, &runtime.CreateContainerRequest{
		PodSandboxId: sb.PodSandboxId,
		Config: &runtime.ContainerConfig{
			Metadata:    &runtime.ContainerMetadata{Name: "gpu"},
			Image:       &runtime.ImageSpec{Image: image},
			Command:     []string{"/pause"},
			Annotations: annotations,
			CDIDevices:  devices,
		},
		SandboxConfig: sandboxConfig,
	})
	if err != nil {
		return fmt.Errorf("CreateContainer: %w", err)
	}
	defer func() {
		c, cl := context.WithTimeout(context.Background(), 30*time.Second)
		defer cl()
		_, _ = rt.RemoveContainer(c, &runtime.RemoveContainerRequest{ContainerId: created.ContainerId})
	}()
	st, err := rt.ContainerStatus(ctx, &runtime.ContainerStatusRequest{ContainerId: created.ContainerId, Verbose: true})
	if err != nil {
		return fmt.Errorf("ContainerStatus: %w", err)
	}
	var info struct {
		RuntimeSpec json.RawMessage `json:"runtimeSpec"`
	}
	if err := json.Unmarshal([]byte(st.Info["info"]), &info); err != nil {
		return fmt.Errorf("ContainerStatus info: %w", err)
	}
	return json.NewEncoder(os.Stdout).Encode(output{RuntimeSpec: info.RuntimeSpec})
}

func main() {
	address := flag.String("address", "", "containerd socket")
	image := flag.String("image", "", "image reference (already in containerd's k8s.io namespace)")
	cdi := flag.String("cdi", "", "comma-separated CDI device names for the CDIDevices field")
	var annotations listFlag
	flag.Var(&annotations, "annotation", "KEY=VALUE container annotation (repeatable)")
	flag.Parse()
	if *address == "" || *image == "" {
		fmt.Fprintln(os.Stderr, "usage: cri-cdi -address SOCK -image REF [-cdi names] [-annotation K=V ...]")
		os.Exit(2)
	}
	names := []string{}
	for _, n := range strings.Split(*cdi, ",") {
		if n = strings.TrimSpace(n); n != "" {
			names = append(names, n)
		}
	}
	ann := map[string]string{}
	for _, a := range annotations {
		k, v, ok := strings.Cut(a, "=")
		if !ok {
			fmt.Fprintln(os.Stderr, "cri-cdi: -annotation wants KEY=VALUE, got", a)
			os.Exit(2)
		}
		ann[k] = v
	}
	if err := run(*address, *image, names, ann); err != nil {
		fmt.Fprintln(os.Stderr, "cri-cdi:", err)
		os.Exit(1)
	}
}
