//go:build !k8s137

// The kubelet APIs of Kubernetes 1.34 (the release pinned in go.mod).
package main

import (
	"context"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
)

func runPluginManager(_ context.Context, pm pluginmanager.PluginManager, ready config.SourcesReady, stop <-chan struct{}) {
	pm.Run(ready, stop)
}

func updateAllocatedResourcesStatus(m *dra.Manager, pod *v1.Pod, status *v1.PodStatus) {
	m.UpdateAllocatedResourcesStatus(pod, status)
}

func startManager(ctx context.Context, m *dra.Manager, pods dra.ActivePodsFunc, node *v1.Node, ready config.SourcesReady) error {
	return m.Start(ctx, pods, func() (*v1.Node, error) { return node, nil }, ready)
}

type pluginHandler = cache.PluginHandler

func (h *hostRootHandler) ValidatePlugin(name string, endpoint string, versions []string) error {
	return h.inner.ValidatePlugin(name, h.dialled(endpoint), versions)
}

func (h *hostRootHandler) RegisterPlugin(name, endpoint string, versions []string, timeout *time.Duration) error {
	return h.inner.RegisterPlugin(name, h.dialled(endpoint), versions, timeout)
}

func (h *hostRootHandler) DeRegisterPlugin(name, endpoint string) {
	h.inner.DeRegisterPlugin(name, h.dialled(endpoint))
}
