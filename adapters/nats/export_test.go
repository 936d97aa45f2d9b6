package nats

// The adapter's defaults, for the tests that check them.
var (
	DefaultStreamName  = defaultStreamName
	ExponentialBackoff = exponentialBackoff
)
