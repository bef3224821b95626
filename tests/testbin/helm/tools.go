//go:build tools

// Package tools pins the helm command in go.mod.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
