package childproc

import (
	"os/exec"
	"syscall"
)

// dieWithParent makes the kernel SIGKILL the child when the parent dies, so that a
// test binary that is killed, or times out, leaves no child behind.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
