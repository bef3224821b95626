// Command dra-harness runs the kubelet's own DRA side (from the pinned k8s.io/kubernetes release) outside
// a kubelet: the plugin watcher (pkg/kubelet/pluginmanager) on a plugins_registry directory, and the DRA
// manager (pkg/kubelet/cm/dra.Manager) that registers DRA drivers found there, reads ResourceClaims from
// the API server, calls the driver's NodePrepareResources/NodeUnprepareResources, keeps its own claim
// checkpoint and consumes the driver's NodeWatchResources health stream (the ResourceHealthStatus
// feature gate is switched on here).
//
// With --pod-resources-socket S the harness also serves the kubelet's PodResources v1 API on S
// (podresources.go): List reports the pods prepared and not yet unprepared, with the claims the DRA manager
// holds for each container.
//
// With --host-root R the harness stands for a kubelet whose host filesystem is R: the endpoint a plugin
// registers (an absolute path on that host) is dialled at R+endpoint. The plugin watcher's handler is
// wrapped to rewrite the endpoint; the kubelet code itself is unchanged.
//
// Commands arrive as JSON lines on stdin and every command gets exactly one JSON line on stdout:
//
//	{"cmd": "wait_registered", "driver": D, "timeout": SECONDS}
//	{"cmd": "prepare", "pod": POD}      -> {"ok": true, "cdi": {CONTAINER: [CDI IDs]}}
//	{"cmd": "unprepare", "pod": POD}
//	{"cmd": "health", "pod": POD}       -> {"ok": true, "status": {CONTAINER: [ResourceStatus]}}
//	{"cmd": "quit"}
//
// POD is {"namespace", "name", "uid", "claims": [{"name", "claim", "template"}], "containers": [{"name",
// "claims": [..]}]} where "claim" names an existing ResourceClaim. Without "template" the pod references it
// by name (spec.resourceClaims[].resourceClaimName); with "template" the pod claim comes from that
// ResourceClaimTemplate, as the API server holds such a pod: spec.resourceClaims[].resourceClaimTemplateName
// and status.resourceClaimStatuses naming the generated claim (the kubelet then checks that the pod owns
// it). Failures answer {"error": MESSAGE}.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	draplugin "k8s.io/kubernetes/pkg/kubelet/cm/dra/plugin"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

type podClaim struct {
	Name     string `json:"name"`
	Claim    string `json:"claim"`
	Template string `json:"template,omitempty"`
}

type podContainer struct {
	Name   string   `json:"name"`
	Claims []string `json:"claims"`
}

type podSpec struct {
	Namespace  string         `json:"namespace"`
	Name       string         `json:"name"`
	UID        string         `json:"uid"`
	Claims     []podClaim     `json:"claims"`
	Containers []podContainer `json:"containers"`
}

type command struct {
	Cmd     string   `json:"cmd"`
	Driver  string   `json:"driver"`
	Timeout float64  `json:"timeout"`
	Pod     *podSpec `json:"pod"`
}

type harness struct {
	manager *dra.Manager
	mu      sync.Mutex
	pods    map[types.UID]*v1.Pod
}

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the API server")
	registry := flag.String("registry-dir", "", "the kubelet's plugins_registry directory to watch")
	stateDir := flag.String("state-dir", "", "where the DRA manager keeps its checkpoint")
	nodeName := flag.String("node-name", "dra-node", "the node this kubelet stands for")
	verbosity := flag.String("v", "0", "klog verbosity of the kubelet code (logs go to stderr)")
	hostRoot := flag.String("host-root", "", "the host filesystem of this kubelet: registered endpoints are dialled under it")
	podResourcesSocket := flag.String("pod-resources-socket", "", "serve the kubelet's PodResources v1 API on this Unix socket")
	flag.Parse()
	if *kubeconfig == "" || *registry == "" || *stateDir == "" {
		fatal("--kubeconfig, --registry-dir and --state-dir are required")
	}
	klogFlags := flag.NewFlagSet("klog", flag.ExitOnError)
	klog.InitFlags(klogFlags)
	_ = klogFlags.Set("v", *verbosity)
	_ = klogFlags.Set("logtostderr", "true")
	if err := utilfeature.DefaultMutableFeatureGate.Set("ResourceHealthStatus=true," + podResourcesGates); err != nil {
		fatal("feature gate: " + err.Error())
	}

	cfg, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fatal("kubeconfig: " + err.Error())
	}
	// The kubelet's own client limits (KubeletConfiguration kubeAPIQPS 50, kubeAPIBurst 100), not client-go's
	// defaults (5 and 10): with those, every claim GET past the tenth in a burst waited about 200 ms.
	cfg.QPS, cfg.Burst = 50, 100
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		fatal("client: " + err.Error())
	}
	for _, d := range []string{*registry, *stateDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			fatal(err.Error())
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	manager, err := dra.NewManager(klog.Background(), client, *stateDir)
	if err != nil {
		fatal("DRA manager: " + err.Error())
	}
	h := &harness{manager: manager, pods: map[types.UID]*v1.Pod{}}
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: *nodeName, UID: types.UID("node-" + *nodeName)}}
	ready := config.NewSourcesReady(func(_ sets.Set[string]) bool { return true })
	if err := startManager(ctx, manager, h.activePods, node, ready); err != nil {
		fatal("starting the DRA manager: " + err.Error())
	}
	if *podResourcesSocket != "" {
		if err := servePodResources(ctx, h, *podResourcesSocket); err != nil {
			fatal("PodResources server: " + err.Error())
		}
	}
	plugins := pluginmanager.NewPluginManager(*registry, &record.FakeRecorder{})
	handler := manager.GetWatcherHandler()
	if *hostRoot != "" {
		handler = &hostRootHandler{inner: handler, root: *hostRoot}
	}
	plugins.AddHandler(registerapi.DRAPlugin, handler)
	stop := make(chan struct{})
	go runPluginManager(ctx, plugins, ready, stop)

	h.serve(ctx)
	close(stop)
}

// hostRootHandler passes the plugin watcher's calls on to the DRA manager's handler with each absolute
// endpoint moved under root (the methods, whose signatures differ between releases, are in compat_*.go).
type hostRootHandler struct {
	inner pluginHandler
	root  string
}

func (h *hostRootHandler) dialled(endpoint string) string {
	if !filepath.IsAbs(endpoint) {
		return endpoint
	}
	return filepath.Join(h.root, endpoint)
}

func fatal(msg string) {
	fmt.Fprintln(os.Stderr, "dra-harness:", msg)
	os.Exit(2)
}

func (h *harness) activePods() []*v1.Pod {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]*v1.Pod, 0, len(h.pods))
	for _, p := range h.pods {
		out = append(out, p)
	}
	return out
}

func toPod(s *podSpec) *v1.Pod {
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: s.Namespace, Name: s.Name, UID: types.UID(s.UID)}}
	for _, c := range s.Claims {
		name, template := c.Claim, c.Template
		if template == "" {
			pod.Spec.ResourceClaims = append(pod.Spec.ResourceClaims, v1.PodResourceClaim{Name: c.Name, ResourceClaimName: &name})
			continue
		}
		pod.Spec.ResourceClaims = append(pod.Spec.ResourceClaims, v1.PodResourceClaim{Name: c.Name, ResourceClaimTemplateName: &template})
		pod.Status.ResourceClaimStatuses = append(pod.Status.ResourceClaimStatuses, v1.PodResourceClaimStatus{Name: c.Name, ResourceClaimName: &name})
	}
	for _, c := range s.Containers {
		ctr := v1.Container{Name: c.Name}
		for _, n := range c.Claims {
			ctr.Resources.Claims = append(ctr.Resources.Claims, v1.ResourceClaim{Name: n})
		}
		pod.Spec.Containers = append(pod.Spec.Containers, ctr)
	}
	return pod
}

func (h *harness) serve(ctx context.Context) {
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<20)
	out := json.NewEncoder(os.Stdout)
	for in.Scan() {
		var c command
		if err := json.Unmarshal(in.Bytes(), &c); err != nil {
			_ = out.Encode(map[string]any{"error": "bad command: " + err.Error()})
			continue
		}
		if c.Cmd == "quit" {
			_ = out.Encode(map[string]any{"ok": true})
			return
		}
		_ = out.Encode(h.handle(ctx, &c))
	}
}

func (h *harness) handle(ctx context.Context, c *command) map[string]any {
	if c.Cmd != "wait_registered" && c.Pod == nil {
		return map[string]any{"error": c.Cmd + ": missing pod"}
	}
	switch c.Cmd {
	case "wait_registered":
		pm, ok := h.manager.GetWatcherHandler().(*draplugin.DRAPluginManager)
		if !ok {
			return map[string]any{"error": "unexpected watcher handler type"}
		}
		deadline := time.Now().Add(time.Duration(c.Timeout * float64(time.Second)))
		for {
			if _, err := pm.GetPlugin(c.Driver); err == nil {
				return map[string]any{"ok": true}
			} else if time.Now().After(deadline) {
				return map[string]any{"error": err.Error()}
			}
			time.Sleep(5 * time.Millisecond)
		}
	case "prepare":
		pod := toPod(c.Pod)
		h.mu.Lock()
		h.pods[pod.UID] = pod
		h.mu.Unlock()
		start := time.Now()
		if err := h.manager.PrepareResources(ctx, pod); err != nil {
			return map[string]any{"error": err.Error()}
		}
		elapsed := time.Since(start).Seconds()
		cdi := map[string][]string{}
		for i := range pod.Spec.Containers {
			ctr := &pod.Spec.Containers[i]
			info, err := h.manager.GetResources(pod, ctr)
			if err != nil {
				return map[string]any{"error": err.Error()}
			}
			ids := []string{}
			for _, d := range info.CDIDevices {
				ids = append(ids, d.Name)
			}
			cdi[ctr.Name] = ids
		}
		return map[string]any{"ok": true, "cdi": cdi, "seconds": elapsed}
	case "unprepare":
		pod := toPod(c.Pod)
		if err := h.manager.UnprepareResources(ctx, pod); err != nil {
			return map[string]any{"error": err.Error()}
		}
		h.mu.Lock()
		delete(h.pods, pod.UID)
		h.mu.Unlock()
		return map[string]any{"ok": true}
	case "health":
		pod := toPod(c.Pod)
		status := &v1.PodStatus{}
		for _, ctr := range pod.Spec.Containers {
			status.ContainerStatuses = append(status.ContainerStatuses, v1.ContainerStatus{Name: ctr.Name})
		}
		updateAllocatedResourcesStatus(h.manager, pod, status)
		res := map[string]any{}
		for _, cs := range status.ContainerStatuses {
			res[cs.Name] = cs.AllocatedResourcesStatus
		}
		return map[string]any{"ok": true, "status": res}
	}
	return map[string]any{"error": "unknown command " + c.Cmd}
}
