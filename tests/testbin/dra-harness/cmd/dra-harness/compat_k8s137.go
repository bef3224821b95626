//go:build k8s137

// The kubelet APIs of Kubernetes 1.37 (built with -modfile=go-1.37.mod -tags k8s137): the plugin manager,
// the node getter and the resource status update take a context / logger.
package main

import (
	"context"

	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
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
