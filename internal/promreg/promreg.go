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

// ShardLabel is the label every series of a shard map's per-shard part carries:
// the shard's name.
const ShardLabel = "shard"

// Shard returns reg with the constant label shard=name on every series registered
// through it, the Registerer of a shard map's per-shard part (nil for a nil reg).
// The label is in the collectors' descriptions, so recording a sample costs nothing
// more. Prometheus refuses two registrations of a family with different label
// names on one registry, so a family's series on one registry are either all
// per-shard or all single-database.
func Shard(reg prometheus.Registerer, name string) prometheus.Registerer {
	if reg == nil {
		return nil
	}
	return prometheus.WrapRegistererWith(prometheus.Labels{ShardLabel: name}, reg)
}
