package chaos_test

import (
	"fmt"
	"os"
)

// runChild runs a re-executed test binary in the given role and returns its exit
// code. The parent test kills it, or lets it finish.
func runChild(role string) int {
	fmt.Fprintf(os.Stderr, "unknown child role %q\n", role)
	return 2
}
