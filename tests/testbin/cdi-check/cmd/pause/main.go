// Command pause waits for SIGTERM or SIGINT and exits 0: the sandbox process of the test image that the
// CRI tests import into containerd (no registry involved).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGTERM, syscall.SIGINT)
	<-ch
}
