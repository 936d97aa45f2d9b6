// Command metrics runs a consumer, an effects dispatcher and the janitor on one
// Prometheus registry, together with Watermill's own router metrics, and serves
// them on /metrics. A producer sends payments, some of them twice and some that
// fail, so every idem_* series moves.
//
//	go run ./examples/metrics -addr :9464
//	curl -s localhost:9464/metrics | grep -E '^(idem|watermill)_'
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wmetrics "github.com/ThreeDotsLabs/watermill/components/metrics"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/effects"
	"github.com/idemkit/idem/janitor"
	"github.com/idemkit/idem/migrate"
)

func main() {
	var cfg config
	flag.StringVar(&cfg.addr, "addr", ":9464", "where to serve /metrics")
	flag.StringVar(&cfg.databaseURL, "database-url", cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"), "Postgres DSN")
	flag.StringVar(&cfg.schema, "schema", "idem_example_metrics", "schema for the idem tables")
	flag.DurationVar(&cfg.every, "every", 200*time.Millisecond, "time between two payments")
	flag.DurationVar(&cfg.runFor, "run-for", 0, "stop after this long (0: until Ctrl-C)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	cancel := context.CancelFunc(func() {})
	if cfg.runFor > 0 {
		ctx, cancel = context.WithTimeout(ctx, cfg.runFor)
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	ln, err := net.Listen("tcp", cfg.addr)
	if err == nil {
		logger.Info("serving metrics", "url", "http://"+ln.Addr().String()+"/metrics")
		err = run(ctx, cfg, ln, logger)
	}
	cancel()
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

type config struct {
	addr, databaseURL, schema string
	every, runFor             time.Duration
}

// run wires everything to one registry and serves it on ln until ctx ends.
func run(ctx context.Context, cfg config, ln net.Listener, logger *slog.Logger) (err error) {
	pool, err := pgxpool.New(ctx, cfg.databaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	m, err := migrate.New(migrate.Config{Pool: pool, Schema: cfg.schema})
	if err != nil {
		return err
	}
	if _, err := m.Up(ctx); err != nil {
		return fmt.Errorf("migrate (is Postgres running? docker compose up -d postgres): %w", err)
	}

	// One registry for everything: idem's collectors, Watermill's router metrics
	// and the Go runtime's.
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	wlog := watermill.NewSlogLogger(logger)
	pubSub := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, wlog)
	router, err := message.NewRouter(message.RouterConfig{}, wlog)
	if err != nil {
		return err
	}
	wmetrics.NewPrometheusMetricsBuilder(reg, "watermill", "").AddPrometheusRouterMetrics(router)

	c, err := consumer.New(consumer.Config{
		Name: "payments", Pool: pool, Schema: cfg.schema,
		Tenant:      consumer.MetadataKey("tenant"),
		MessageTime: sentAt,
		Logger:      logger,
		Registerer:  reg,
	})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, c.Close()) }()
	router.AddConsumerHandler("payments", "payments", pubSub, func(msg *message.Message) error {
		ctx := msg.Context()
		if string(msg.Payload) == `{"card":"declined"}` {
			return consumer.Permanent(errors.New("card declined"))
		}
		_, err := effects.Enqueue(ctx, consumer.Tx(ctx), effects.Effect{
			Kind: "email", Key: "receipt:" + msg.UUID, Payload: msg.Payload,
		})
		return err
	}).AddMiddleware(c.Middleware)

	dispatcher, err := effects.NewDispatcher(effects.Config{
		Pool: pool, Schema: cfg.schema,
		Senders: map[string]effects.Sender{
			"email": effects.SenderFunc(func(ctx context.Context, d effects.Delivery) error {
				return nil // a real sender passes d.Key to the provider as its idempotency key
			}),
		},
		Logger:     logger,
		Registerer: reg,
	})
	if err != nil {
		return err
	}
	jan, err := janitor.New(janitor.Config{
		Pool: pool, Schema: cfg.schema, Interval: 10 * time.Second, Logger: logger, Registerer: reg,
	})
	if err != nil {
		return err
	}

	srv := &http.Server{Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	go func() { _ = dispatcher.Run(ctx) }()
	go func() { _ = jan.Run(ctx) }()
	go produce(ctx, pubSub, cfg.every)

	err = router.Run(ctx)
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(shutdownCtx)
	return err
}

// produce publishes a payment every interval. Every fourth message is sent twice
// (a duplicate), every seventh is declined (a permanent failure), and every tenth
// is stamped as sent eight days ago (an expired retry).
func produce(ctx context.Context, pub message.Publisher, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for i := 1; ; i++ {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		payload := `{"amount":` + strconv.Itoa(i) + `}`
		if i%7 == 0 {
			payload = `{"card":"declined"}`
		}
		msg := message.NewMessage(watermill.NewUUID(), []byte(payload))
		msg.Metadata.Set("tenant", []string{"acme", "globex"}[i%2])
		sent := time.Now()
		if i%10 == 0 {
			sent = sent.Add(-8 * 24 * time.Hour)
		}
		msg.Metadata.Set("sent_at", sent.Format(time.RFC3339))
		copies := 1
		if i%4 == 0 {
			copies = 2
		}
		for range copies {
			if err := pub.Publish("payments", msg.Copy()); err != nil {
				return
			}
		}
	}
}

func sentAt(msg *message.Message) (time.Time, bool) {
	at, err := time.Parse(time.RFC3339, msg.Metadata.Get("sent_at"))
	return at, err == nil
}
