// Test helpers for CDI: cdi-check drives the CDI reference library (pkg/cdi): load spec directories, list the
// devices, inject device names into an OCI spec; cmd/cri-cdi creates a container through CRI with CDI devices.
module nodeagent.test/cdi-check

go 1.26.0

require (
	github.com/opencontainers/runtime-spec v1.3.0
	google.golang.org/grpc v1.83.2
	k8s.io/cri-api v0.37.0
	tags.cncf.io/container-device-interface v1.1.1
)

require (
	github.com/fsnotify/fsnotify v1.7.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
	golang.org/x/net v0.58.0 // indirect
	golang.org/x/sys v0.47.0 // indirect
	golang.org/x/text v0.41.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20260526163538-3dc84a4a5aaa // indirect
	google.golang.org/protobuf v1.36.12-0.20260120151049-f2248ac996af // indirect
	tags.cncf.io/container-device-interface/specs-go v1.1.1 // indirect
)
