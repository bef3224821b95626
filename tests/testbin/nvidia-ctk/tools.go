//go:build tools

// Package tools pins the nvidia-ctk command in go.mod.
package tools

import _ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk"
