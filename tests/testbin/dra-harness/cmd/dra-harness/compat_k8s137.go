//go:build k8s137

// The kubelet APIs of Kubernetes 1.37 (built with -modfile=go-1.37.mod -tags k8s137): the plugin manager,
// the node getter, the resource status update and the plugin watcher's handler take a context / logger.
package main

import (
	"context"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
)

func runPluginManager(ctx context.Context, pm pluginmanager.PluginManager, ready config.SourcesReady, stop <-chan struct{}) {
	pm.Run(ctx, ready, stop)
}

func updateAllocatedResourcesStatus(m *dra.Manager, pod *v1.Pod, status *v1.PodStatus) {
	m.UpdateAllocatedResourcesStatus(klog.Background(), pod, status)
}

func startManager(ctx context.Context, m *dra.Manager, pods dra.ActivePodsFunc, node *v1.Node, ready config.SourcesReady) error {
	return m.Start(ctx, pods, func(context.Context) (*v1.Node, error) { return node, nil }, ready)
}

type pluginHandler = cache.PluginHandler

func (h *hostRootHandler) ValidatePlugin(ctx context.Context, name string, endpoint string, versions []string) error {
	return h.inner.ValidatePlugin(ctx, name, h.dialled(endpoint), versions)
}

func (h *hostRootHandler) RegisterPlugin(ctx context.Context, name, endpoint string, versions []string, timeout *time.Duration) error {
	return h.inner.RegisterPlugin(ctx, name, h.dialled(endpoint), versions, timeout)
}

func (h *hostRootHandler) DeRegisterPlugin(ctx context.Context, name, endpoint string) {
	h.inner.DeRegisterPlugin(ctx, name, h.dialled(endpoint))
}
