package cpustat

import (
	"runtime/metrics"
	"time"
)

// runtimeCPU is the runtime's own estimate of the CPU time its Ps spent so far:
// in the garbage collector, and in all but idleness. The runtime derives these
// from wall-clock time, so they overstate CPU time on a machine whose cores are
// busy with other processes; their ratio over a window is what Delta.GCShare
// keeps.
func runtimeCPU() (gc, busy time.Duration) {
	s := []metrics.Sample{
		{Name: "/cpu/classes/gc/total:cpu-seconds"},
		{Name: "/cpu/classes/total:cpu-seconds"},
		{Name: "/cpu/classes/idle:cpu-seconds"},
	}
	metrics.Read(s)
	v := func(i int) time.Duration {
		if s[i].Value.Kind() != metrics.KindFloat64 {
			return 0
		}
		return time.Duration(s[i].Value.Float64() * float64(time.Second))
	}
	return v(0), v(1) - v(2)
}
