package main

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/inbox"
)

// The console's page: plain HTML, CSS and JavaScript, embedded in the binary. No
// build step, no CDN, no external font: it works on a machine with no internet.
//
//go:embed console
var consoleFiles embed.FS

const defaultConsoleAddr = "127.0.0.1:8080"

var consoleCmd = &command{
	name:    "console",
	args:    "[--addr HOST:PORT] [--read-only] [--allow-remote] [flags]",
	summary: "Serve a web console: stats, dead and stuck effects with their errors, any key across inbox and effects, requeue",
	example: `idem console                                 # http://127.0.0.1:8080/
idem console --addr 127.0.0.1:9000 --read-only --schema idem

The console listens on loopback only. To reach it from another machine, use an
SSH tunnel (ssh -L 8080:127.0.0.1:8080 host), or pass --allow-remote with a
non-loopback --addr: it has no login of its own, so put it behind an
authenticating proxy. --read-only hides the requeue button and refuses requeue
requests on the server. A requeue needs the page's token and a same-origin
request (CSRF protection); every requeue is logged on stderr.`,
	setup: func(fs *flag.FlagSet) runFunc {
		var o consoleOptions
		fs.StringVar(&o.addr, "addr", defaultConsoleAddr, "address to listen on")
		fs.BoolVar(&o.readOnly, "read-only", false, "show, but never change anything: no requeue")
		fs.BoolVar(&o.allowRemote, "allow-remote", false, "allow a non-loopback --addr (the console has no login: put it behind an authenticating proxy)")
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			return runConsole(ctx, e, o)
		}
	},
}

type consoleOptions struct {
	addr                  string
	readOnly, allowRemote bool
}

func runConsole(ctx context.Context, e *env, o consoleOptions) error {
	host, _, err := net.SplitHostPort(o.addr)
	if err != nil {
		return usagef("--addr %q: use HOST:PORT, such as %s", o.addr, defaultConsoleAddr)
	}
	if !o.allowRemote && !isLoopback(host) {
		return usagef("--addr %q is not a loopback address: the console has no login of its own. "+
			"Use an SSH tunnel to 127.0.0.1, or pass --allow-remote and put an authenticating proxy in front of it", o.addr)
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w (is another console or program using the port? choose another with --addr)", o.addr, err)
	}
	h, err := newConsole(a, consoleConfig{ReadOnly: o.readOnly, Logger: e.logger(), Hosts: consoleHosts(ln.Addr(), o.allowRemote)})
	if err != nil {
		ln.Close()
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(e.logger().Handler(), slog.LevelWarn)}
	mode := ""
	if o.readOnly {
		mode = ", read-only"
	}
	fmt.Fprintf(e.stderr, "idem console: http://%s/ (schema %s%s); Ctrl-C stops it\n", ln.Addr(), e.schema, mode)
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	shutdown, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shutdown); err != nil {
		return err
	}
	return nil
}

// isLoopback reports whether host names only loopback addresses.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// consoleHosts are the Host headers the console answers on a loopback address:
// the address itself and localhost, with its port. A page of another site that a
// DNS name pointed at 127.0.0.1 (DNS rebinding) sends its own name, and is
// refused. With --allow-remote, any name (nil): the proxy in front decides.
func consoleHosts(addr net.Addr, remote bool) []string {
	if remote {
		return nil
	}
	_, port, _ := net.SplitHostPort(addr.String())
	return []string{addr.String(), net.JoinHostPort("localhost", port), net.JoinHostPort("127.0.0.1", port), net.JoinHostPort("::1", port)}
}

// consoleConfig configures the console's handler.
type consoleConfig struct {
	ReadOnly bool
	Logger   *slog.Logger
	// Hosts are the Host headers accepted; nil accepts any.
	Hosts []string
}

// console serves the page and its JSON endpoints, which call the admin API.
type console struct {
	admin *admin.Admin
	cfg   consoleConfig
	// token must come back in the X-Idem-Token header of every POST. The page
	// reads it from /api/session, which another origin cannot read.
	token string
}

const tokenHeader = "X-Idem-Token"

func newConsole(a *admin.Admin, cfg consoleConfig) (http.Handler, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return nil, err
	}
	c := &console{admin: a, cfg: cfg, token: hex.EncodeToString(b)}
	static, err := fs.Sub(consoleFiles, "console")
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /", http.FileServerFS(static))
	mux.HandleFunc("GET /api/session", c.session)
	mux.HandleFunc("GET /api/stats", c.stats)
	mux.HandleFunc("GET /api/effects", c.effects)
	mux.HandleFunc("GET /api/effect", c.effect)
	mux.HandleFunc("GET /api/inbox", c.inboxList)
	mux.HandleFunc("GET /api/inbox/key", c.inboxKey)
	mux.HandleFunc("GET /api/find", c.find)
	// Go's cross-origin protection refuses a POST whose Sec-Fetch-Site or Origin
	// says it comes from another site; the token covers old browsers that send
	// neither.
	mux.Handle("POST /api/requeue", http.NewCrossOriginProtection().Handler(http.HandlerFunc(c.requeue)))
	return c.guard(mux), nil
}

// guard checks the Host header and sets the headers of every answer: a strict
// Content-Security-Policy (the page's own script and style only: even if some text
// were ever rendered as HTML, no inline script would run), no framing, no sniffing.
func (c *console) guard(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("Cache-Control", "no-store")
		if c.cfg.Hosts != nil && !hostAllowed(c.cfg.Hosts, r.Host) {
			writeError(w, http.StatusMisdirectedRequest, "bad_host",
				fmt.Sprintf("this console answers to Host %s only", strings.Join(c.cfg.Hosts, ", ")))
			return
		}
		next.ServeHTTP(w, r)
	})
}

func hostAllowed(hosts []string, host string) bool {
	for _, h := range hosts {
		if strings.EqualFold(h, host) {
			return true
		}
	}
	return false
}

type apiError struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, status int, code, msg string) {
	writeJSON(w, status, apiError{Code: code, Message: msg})
}

// fail answers err with the status its code calls for.
func (c *console) fail(w http.ResponseWriter, r *http.Request, err error) {
	_, code := classify(err)
	status := http.StatusInternalServerError
	switch {
	case errors.Is(err, admin.ErrNotFound):
		status = http.StatusNotFound
	case errors.Is(err, admin.ErrNotDead):
		status = http.StatusConflict
	case isBadInput(err) || inbox.IsPermanent(err):
		status = http.StatusBadRequest
	case errors.Is(err, inbox.ErrSchemaMissing):
		status = http.StatusServiceUnavailable
	}
	if status == http.StatusInternalServerError {
		c.cfg.Logger.Error("idem console: request failed", slog.String("path", r.URL.Path), slog.Any("err", err))
	}
	writeError(w, status, code, err.Error())
}

type sessionJSON struct {
	Schema   string `json:"schema"`
	ReadOnly bool   `json:"read_only"`
	Token    string `json:"token,omitempty"`
	Version  string `json:"version"`
}

func (c *console) session(w http.ResponseWriter, r *http.Request) {
	s := sessionJSON{Schema: c.admin.Schema(), ReadOnly: c.cfg.ReadOnly, Version: buildVersion()}
	if !c.cfg.ReadOnly {
		s.Token = c.token
	}
	writeJSON(w, http.StatusOK, s)
}

func (c *console) stats(w http.ResponseWriter, r *http.Request) {
	s, err := c.admin.Stats(r.Context())
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, s)
}

// optional reads a query parameter that may be absent (nil) or empty (the
// unscoped tenant).
func optional(r *http.Request, name string) *string {
	q := r.URL.Query()
	if !q.Has(name) {
		return nil
	}
	v := q.Get(name)
	return &v
}

func page(r *http.Request) (admin.Page, error) {
	p := admin.Page{After: r.URL.Query().Get("after")}
	if l := r.URL.Query().Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil {
			return p, codedf(admin.ErrBadFilter, "limit %q is not a number", l)
		}
		p.Limit = n
	}
	return p, nil
}

func (c *console) effects(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := admin.EffectFilter{Tenant: optional(r, "tenant"), Kind: q.Get("kind"), State: q.Get("state"),
		Stuck: q.Get("stuck") == "1", KeyPrefix: q.Get("prefix"), Consumer: q.Get("consumer")}
	p, err := page(r)
	if err == nil {
		var out *admin.EffectPage
		if out, err = c.admin.ListEffects(r.Context(), f, p); err == nil {
			writeJSON(w, http.StatusOK, out)
			return
		}
	}
	c.fail(w, r, err)
}

func (c *console) effect(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	e, err := c.admin.InspectEffect(r.Context(), admin.EffectID{Tenant: q.Get("tenant"), Kind: q.Get("kind"), Key: q.Get("key")})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, e)
}

func (c *console) inboxList(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := admin.InboxFilter{Consumer: q.Get("consumer"), Tenant: optional(r, "tenant"), State: q.Get("state"), KeyPrefix: q.Get("prefix")}
	p, err := page(r)
	if err == nil {
		var out *admin.InboxPage
		if out, err = c.admin.ListInbox(r.Context(), f, p); err == nil {
			writeJSON(w, http.StatusOK, out)
			return
		}
	}
	c.fail(w, r, err)
}

func (c *console) inboxKey(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	// Never the body: it may hold personal data, and the console shows its size.
	k, err := c.admin.InspectInbox(r.Context(), inbox.ID{Consumer: q.Get("consumer"), Tenant: q.Get("tenant"), Key: q.Get("key")}, admin.InspectOptions{})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, k)
}

func (c *console) find(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	found, err := c.admin.Find(r.Context(), q.Get("key"), admin.FindFilter{Tenant: optional(r, "tenant"), Kind: q.Get("kind")})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, found)
}

func (c *console) requeue(w http.ResponseWriter, r *http.Request) {
	if c.cfg.ReadOnly {
		writeError(w, http.StatusForbidden, "read_only", "this console is read-only (--read-only): it changes nothing")
		return
	}
	if subtle.ConstantTimeCompare([]byte(r.Header.Get(tokenHeader)), []byte(c.token)) != 1 {
		writeError(w, http.StatusForbidden, "bad_token", "missing or wrong "+tokenHeader+" header: reload the page")
		return
	}
	var id admin.EffectID
	dec := json.NewDecoder(io.LimitReader(r.Body, 64<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&id); err != nil || id.Kind == "" || id.Key == "" {
		writeError(w, http.StatusBadRequest, "bad_request", `send {"tenant": "…", "kind": "…", "key": "…"}`)
		return
	}
	if err := c.admin.Requeue(r.Context(), id); err != nil {
		c.fail(w, r, err)
		return
	}
	c.cfg.Logger.Info("idem console: effect requeued", slog.String("schema", c.admin.Schema()),
		slog.String("tenant", id.Tenant), slog.String("kind", id.Kind), slog.String("key", id.Key),
		slog.String("remote", r.RemoteAddr))
	e, err := c.admin.InspectEffect(r.Context(), id)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, e)
}

func buildVersion() string {
	if v, ok := readBuildInfo(); ok {
		return v.Version
	}
	return "(unknown)"
}
