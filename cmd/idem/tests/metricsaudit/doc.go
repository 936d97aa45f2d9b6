// Package metricsaudit holds tests, and nothing else, that keep idem's Prometheus
// metrics, their documentation and the Grafana dashboard in step:
//
//   - every component (consumer, effects Dispatcher, janitor, httpidem, admin's
//     failure metrics), built on
//     one registry, makes every series a dashboard needs at 0 before any work, and
//     every metric family the spec's Observability section names (a list in the
//     test: the spec lives outside the repository) and the Metrics section of
//     docs/observability.md names is among them, and that page names every one of them;
//   - the Kafka adapter's Subscriber, subscribed to a topic on kfake, registers the
//     idem_kafka_ families that page names, its held gauge at 0 for each partition;
//   - docs/grafana/idem-dashboard.json decodes strictly into the Grafana Foundation
//     SDK's dashboard types (unknown fields refused), and every PromQL expression in
//     it names only metric families, labels and label values that those components
//     register, and uses every family at least once.
//
// It guarantees nothing at run time: it is the tripwire that fails a build when a
// metric is renamed, added or dropped without the docs and the dashboard.
package metricsaudit
