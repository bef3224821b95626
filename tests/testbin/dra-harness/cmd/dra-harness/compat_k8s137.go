//go:build k8s137

// The kubelet APIs of Kubernetes 1.37 (built with -modfile=go-1.37.mod -tags k8s137): the plugin manager
// and the resource status update take a context / logger.
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
