//go:build !k8s137 && !k8s135 && !k8s136

// The kubelet APIs of Kubernetes 1.34 (the release pinned in go.mod).
package main

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
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
