//go:build k8s135

// The kubelet APIs of Kubernetes 1.35 (built with -modfile=go-1.35.mod -tags k8s135): the plugin manager
// takes a context; the DRA manager's node getter and status update are still those of 1.34.
package main

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
)

func runPluginManager(ctx context.Context, pm pluginmanager.PluginManager, ready config.SourcesReady, stop <-chan struct{}) {
	pm.Run(ctx, ready, stop)
}

func updateAllocatedResourcesStatus(m *dra.Manager, pod *v1.Pod, status *v1.PodStatus) {
	m.UpdateAllocatedResourcesStatus(pod, status)
}

func startManager(ctx context.Context, m *dra.Manager, pods dra.ActivePodsFunc, node *v1.Node, ready config.SourcesReady) error {
	return m.Start(ctx, pods, func() (*v1.Node, error) { return node, nil }, ready)
}
