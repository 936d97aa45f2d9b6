// Package promreg registers idem's Prometheus collectors on the Registerer a user
// passes in, the one way every idem package does it. It imports nothing of idem.
package promreg

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Register registers c on reg and returns it, or returns the collector already
// registered on reg under the same description, so that several consumers,
// dispatchers, middlewares or janitors on one registry share their metrics. A nil
// reg registers nothing and returns c. Any other failure is joined to *errp and c
// is returned, so that a constructor registers all of its collectors and reports
// every failure at once.
func Register[C prometheus.Collector](reg prometheus.Registerer, c C, errp *error) C {
	if reg == nil {
		return c
	}
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		*errp = errors.Join(*errp, err)
	}
	return c
}
