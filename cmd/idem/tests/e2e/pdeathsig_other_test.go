//go:build !linux

package e2e

import "os/exec"

// dieWithParent: only Linux has a parent-death signal; elsewhere an interrupted
// run's workers end when their broker and database connections fail.
func dieWithParent(*exec.Cmd) {}
