//go:build k8s137

// The PodResources providers as Kubernetes 1.37 declares them: most take a logger, CPUs and memory are
// asked per pod and container objects, and pod-level CPUs / memory exist (PodLevelResourceManagers).
package main

import (
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra/state"
)

// claimResource also reports the share a device was allocated from (consumable capacity), if any.
func claimResource(driver string, d *state.Device, cdi []*podresourcesv1.CDIDevice) *podresourcesv1.ClaimResource {
	r := claimResourceFields(driver, d, cdi)
	if d.ShareID != nil {
		share := string(*d.ShareID)
		r.ShareId = &share
	}
	return r
}

func (s podResourcesSource) GetDynamicResources(logger klog.Logger, pod *v1.Pod, ctr *v1.Container) []*podresourcesv1.DynamicResource {
	return s.h.dynamicResources(logger, pod, ctr)
}

// No device manager, CPU manager or memory manager: nothing allocated, nothing allocatable.

func (podResourcesSource) UpdateAllocatedDevices(klog.Logger) {}

func (podResourcesSource) GetDevices(string, string) []*podresourcesv1.ContainerDevices { return nil }

func (podResourcesSource) GetAllocatableDevices(klog.Logger) []*podresourcesv1.ContainerDevices {
	return nil
}

func (podResourcesSource) GetCPUs(*v1.Pod, *v1.Container) []int64 { return nil }

func (podResourcesSource) GetPodCPUs(string) []int64 { return nil }

func (podResourcesSource) GetAllocatableCPUs() []int64 { return nil }

func (podResourcesSource) GetMemory(klog.Logger, *v1.Pod, *v1.Container) []*podresourcesv1.ContainerMemory {
	return nil
}

func (podResourcesSource) GetPodMemory(klog.Logger, string) []*podresourcesv1.ContainerMemory {
	return nil
}

func (podResourcesSource) GetAllocatableMemory(klog.Logger) []*podresourcesv1.ContainerMemory {
	return nil
}
