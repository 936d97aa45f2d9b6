//go:build !linux

package kafkagroup

import "os/exec"

// dieWithParent: only Linux has a parent-death signal; elsewhere an
// interrupted run's members end when their broker connections fail.
func dieWithParent(*exec.Cmd) {}
