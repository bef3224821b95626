// Command containerd is the upstream containerd 2 daemon: the command and builtin plugin set of the
// pinned github.com/containerd/containerd/v2 release (see go.mod), so the tests can judge config
// versions 3 and 4, which Debian's containerd 1.x does not read. Built by tests/testbin/setup.sh with
// CGO_ENABLED=0, which already leaves out the cgo-only btrfs snapshotter.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/containerd/containerd/v2/cmd/containerd/command"

	_ "github.com/containerd/containerd/v2/cmd/containerd/builtins"
)

func main() {
	if err := command.App().Run(context.Background(), os.Args); err != nil {
		_, _ = fmt.Fprintln(os.Stderr, "containerd:", err)
		os.Exit(1)
	}
}
