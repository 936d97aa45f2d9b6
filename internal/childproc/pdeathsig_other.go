//go:build !linux

package childproc

import "os/exec"

// dieWithParent does nothing: only Linux has a parent-death signal. Elsewhere a
// child of an interrupted test binary ends at its next write to a closed pipe, or
// when the test's cleanup kills it.
func dieWithParent(*exec.Cmd) {}
