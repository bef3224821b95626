//go:build !k8s137

// The plugin watcher's handler as Kubernetes 1.34 to 1.36 declare it (no context).
package main

import (
	"time"

	"k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
)

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
