package kafkagroup

import (
	"os/exec"
	"syscall"
)

// dieWithParent makes the kernel SIGKILL a member when the test binary dies,
// so an interrupted run leaves no member holding Kafka or Postgres sessions.
func dieWithParent(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
