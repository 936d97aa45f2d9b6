package e2e

import (
	"os/exec"
	"syscall"
)

// dieWithParent makes the kernel SIGKILL a worker when the test binary dies, so an
// interrupted run leaves no workers holding Postgres connections.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
