//go:build !k8s137

// The PodResources providers as Kubernetes 1.34 to 1.36 declare them.
package main

import (
	v1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra/state"
)

func claimResource(driver string, d *state.Device, cdi []*podresourcesv1.CDIDevice) *podresourcesv1.ClaimResource {
	return claimResourceFields(driver, d, cdi)
}

func (s podResourcesSource) GetDynamicResources(pod *v1.Pod, ctr *v1.Container) []*podresourcesv1.DynamicResource {
	return s.h.dynamicResources(klog.Background(), pod, ctr)
}

// No device manager, CPU manager or memory manager: nothing allocated, nothing allocatable.

func (podResourcesSource) UpdateAllocatedDevices() {}

func (podResourcesSource) GetDevices(string, string) []*podresourcesv1.ContainerDevices { return nil }

func (podResourcesSource) GetAllocatableDevices() []*podresourcesv1.ContainerDevices { return nil }

func (podResourcesSource) GetCPUs(string, string) []int64 { return nil }

func (podResourcesSource) GetAllocatableCPUs() []int64 { return nil }

func (podResourcesSource) GetMemory(string, string) []*podresourcesv1.ContainerMemory { return nil }

func (podResourcesSource) GetAllocatableMemory() []*podresourcesv1.ContainerMemory { return nil }
