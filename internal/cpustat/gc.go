package cpustat

import (
	"runtime/metrics"
	"time"
)

const gcMetric = "/cpu/classes/gc/total:cpu-seconds"

// gcCPU is the garbage collector's CPU time so far, 0 if the runtime does not
// report it.
func gcCPU() time.Duration {
	s := []metrics.Sample{{Name: gcMetric}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindFloat64 {
		return 0
	}
	return time.Duration(s[0].Value.Float64() * float64(time.Second))
}
