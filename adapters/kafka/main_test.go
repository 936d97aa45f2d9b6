package kafka_test

import (
	"testing"

	"go.uber.org/goleak"
)

// Every goroutine the Publisher, the Subscriber and kfake start must be gone
// once they are closed.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
