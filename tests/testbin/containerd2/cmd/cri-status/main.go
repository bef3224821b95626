// Command cri-status asks a running containerd's CRI service for its status, the way the kubelet
// does (RuntimeService.Status, verbose), and prints one JSON object: the runtime handlers it serves,
// its conditions and the effective CRI config it runs with (from the verbose info).
//
//	cri-status /path/to/containerd.sock
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtime "k8s.io/cri-api/pkg/apis/runtime/v1"
)

type handler struct {
	Name                    string `json:"name"`
	RecursiveReadOnlyMounts bool   `json:"recursive_read_only_mounts"`
	UserNamespaces          bool   `json:"user_namespaces"`
}

type condition struct {
	Type    string `json:"type"`
	Status  bool   `json:"status"`
	Reason  string `json:"reason,omitempty"`
	Message string `json:"message,omitempty"`
}

type output struct {
	RuntimeHandlers []handler       `json:"runtime_handlers"`
	Conditions      []condition     `json:"conditions"`
	Config          json.RawMessage `json:"config"`
}

func run(socket string) error {
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	resp, err := runtime.NewRuntimeServiceClient(conn).Status(ctx, &runtime.StatusRequest{Verbose: true})
	if err != nil {
		return fmt.Errorf("CRI Status: %w", err)
	}
	out := output{RuntimeHandlers: []handler{}, Conditions: []condition{}, Config: json.RawMessage("null")}
	for _, h := range resp.GetRuntimeHandlers() {
		f := h.GetFeatures()
		out.RuntimeHandlers = append(out.RuntimeHandlers, handler{
			Name:                    h.GetName(),
			RecursiveReadOnlyMounts: f.GetRecursiveReadOnlyMounts(),
			UserNamespaces:          f.GetUserNamespaces(),
		})
	}
	for _, c := range resp.GetStatus().GetConditions() {
		out.Conditions = append(out.Conditions, condition{c.GetType(), c.GetStatus(), c.GetReason(), c.GetMessage()})
	}
	if cfg, ok := resp.GetInfo()["config"]; ok && json.Valid([]byte(cfg)) {
		out.Config = json.RawMessage(cfg)
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: cri-status SOCKET")
		os.Exit(2)
	}
	if err := run(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "cri-status:", err)
		os.Exit(1)
	}
}
