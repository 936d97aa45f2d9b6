package main

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/idemkit/idem/admin"
	"github.com/idemkit/idem/httpidem"
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
	args:    "[--addr HOST:PORT] [--read-only] [--allow-remote] [--allow-host NAME] [flags]",
	summary: "Serve a web console: per-minute charts, stats, dead and stuck effects, any key across inbox and effects, requeue, failure groups with retry, discard and release",
	example: `idem console                                 # http://127.0.0.1:8080/
idem console --addr 127.0.0.1:9000 --read-only --schema idem
IDEM_CONSOLE_TOKEN=$(openssl rand -hex 32) idem console --allow-remote --addr 0.0.0.0:8080 --allow-host idem.internal

The console listens on loopback only, and answers only requests whose Host
header is its own address (or an --allow-host name). To reach it from another
machine, use an SSH tunnel (ssh -L 8080:127.0.0.1:8080 host). --allow-remote
lets it listen on any address and requires an access token for every API
request, reads included: $IDEM_CONSOLE_TOKEN (at least 32 characters), or one
generated at start and printed on stderr with a URL to open
(http://HOST:PORT/#token=...: the fragment never reaches a server or a log).
Scripts send "Authorization: Bearer TOKEN". It serves plain HTTP: put a TLS
proxy in front. --read-only hides the requeue, retry, discard and release
buttons and refuses those requests on the server. Each of them needs the
page's token and a same-origin request (CSRF protection), and is logged on
stderr; a failure group's action is also stored with its note.`,
	setup: func(fs *pflag.FlagSet) runFunc {
		var o consoleOptions
		fs.StringVar(&o.addr, "addr", defaultConsoleAddr, "address to listen on")
		fs.BoolVar(&o.readOnly, "read-only", false, "show, but never change anything: no requeue, retry, discard or release")
		fs.BoolVar(&o.allowRemote, "allow-remote", false, "allow a non-loopback --addr, and require the access token ($"+consoleTokenEnv+", else generated and printed) for every API request")
		fs.Var(&o.allowHosts, "allow-host", "a host name or IP address clients use to reach the console, accepted in the Host header besides its own address (repeatable, or comma-separated)")
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			return runConsole(ctx, e, o)
		}
	},
}

// consoleTokenEnv names the variable that holds the access token of a console
// run with --allow-remote.
const consoleTokenEnv = "IDEM_CONSOLE_TOKEN"

// minConsoleToken is the shortest access token taken from the environment:
// 32 characters, 128 bits as hex.
const minConsoleToken = 32

type consoleOptions struct {
	addr                  string
	readOnly, allowRemote bool
	allowHosts            hostList
}

// hostList is --allow-host: names, repeatable or comma-separated.
type hostList []string

func (l *hostList) String() string { return strings.Join(*l, ",") }

// Type names the value in --help.
func (l *hostList) Type() string { return "name" }

func (l *hostList) Set(s string) error {
	for name := range strings.SplitSeq(s, ",") {
		name = strings.TrimSpace(name)
		if name == "" || strings.ContainsAny(name, "/ ") {
			return fmt.Errorf("%q is not a host name or IP address", name)
		}
		*l = append(*l, name)
	}
	return nil
}

func runConsole(ctx context.Context, e *env, o consoleOptions) error {
	host, _, err := net.SplitHostPort(o.addr)
	if err != nil {
		return usagef("--addr %q: use HOST:PORT, such as %s", o.addr, defaultConsoleAddr)
	}
	if !o.allowRemote && !isLoopback(host) {
		return usagef("--addr %q is not a loopback address. Use an SSH tunnel to 127.0.0.1, "+
			"or pass --allow-remote, which requires an access token for every request", o.addr)
	}
	var token string
	tokenFromEnv := false
	if o.allowRemote {
		if unspecified(host) && len(o.allowHosts) == 0 {
			return usagef("--addr %q listens on every interface: name the hosts clients use to reach it with --allow-host "+
				"(the console refuses any other Host header, against DNS rebinding)", o.addr)
		}
		if token, tokenFromEnv = os.LookupEnv(consoleTokenEnv); tokenFromEnv {
			if len(token) < minConsoleToken {
				return usagef("$%s is %d characters: use at least %d (openssl rand -hex 32)", consoleTokenEnv, len(token), minConsoleToken)
			}
		} else if token, err = randomToken(); err != nil {
			return err
		}
	}
	a, err := e.admin(ctx)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", o.addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w (is another console or program using the port? choose another with --addr)", o.addr, err)
	}
	logger := e.logger()
	h, err := newConsole(a, consoleConfig{ReadOnly: o.readOnly, Logger: logger,
		Hosts: consoleHosts(ln.Addr(), host), Names: o.allowHosts, Token: token})
	if err != nil {
		_ = ln.Close()
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}
	announceConsole(e, logger, o, ln.Addr(), host, token, tokenFromEnv)
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

// announceConsole says where the console listens, on stderr: as text, or as
// JSON log lines with --json. In remote mode it warns first, and gives the URL
// that logs the browser in (the token in the fragment, which no server sees);
// a generated token is printed, one from the environment is not.
func announceConsole(e *env, logger *slog.Logger, o consoleOptions, addr net.Addr, host, token string, fromEnv bool) {
	_, port, _ := net.SplitHostPort(addr.String())
	urlHost := host
	if unspecified(host) {
		urlHost = o.allowHosts[0]
	}
	url := "http://" + net.JoinHostPort(urlHost, port) + "/"
	mode := ""
	if o.readOnly {
		mode = ", read-only"
	}
	if !o.allowRemote {
		if e.json {
			logger.Info("idem console: serving", "url", url, "schema", e.schema, "read_only", o.readOnly)
			return
		}
		fmt.Fprintf(e.stderr, "idem console: %s (schema %s%s); Ctrl-C stops it\n", url, e.schema, mode)
		return
	}
	const warning = "idem console: WARNING: --allow-remote: other machines may reach this console, over plain HTTP " +
		"(put a TLS proxy in front of it, or use an SSH tunnel instead). Every API request needs the access token, " +
		"and whoever has it can read the idem tables"
	write := ", requeue dead effects, and retry, discard or release failure groups."
	if o.readOnly {
		write = " (read-only: no requeue, retry, discard or release)."
	}
	hosts := strings.Join(append(consoleHosts(addr, host), o.allowHosts...), ", ")
	login := url + "#token="
	if fromEnv {
		login += "$" + consoleTokenEnv
	} else {
		login += token
	}
	if e.json {
		logger.Warn(warning+write, "hosts", hosts)
		attrs := []any{"url", url, "login_url", login, "schema", e.schema, "read_only", o.readOnly}
		if !fromEnv {
			attrs = append(attrs, "token", token)
		}
		logger.Info("idem console: serving", attrs...)
		return
	}
	fmt.Fprintf(e.stderr, "%s%s\nidem console: answers to Host %s\n", warning, write, hosts)
	if fromEnv {
		fmt.Fprintf(e.stderr, "idem console: access token: $%s\n", consoleTokenEnv)
	} else {
		fmt.Fprintf(e.stderr, "idem console: access token (generated; set $%s to choose one): %s\n", consoleTokenEnv, token)
	}
	fmt.Fprintf(e.stderr, "idem console: open %s (the token is in the URL's fragment, which the browser never sends); "+
		"scripts send \"Authorization: Bearer TOKEN\"\n", login)
	fmt.Fprintf(e.stderr, "idem console: %s (schema %s%s); Ctrl-C stops it\n", url, e.schema, mode)
}

// randomToken returns 32 random bytes as hex.
func randomToken() (string, error) {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return hex.EncodeToString(b), nil
}

// unspecified reports whether host listens on every interface ("", 0.0.0.0, ::).
func unspecified(host string) bool {
	if host == "" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsUnspecified()
}

// isLoopback reports whether host names only loopback addresses.
func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// consoleHosts are the Host headers (with the port) the console answers to: its
// loopback names, and the address it listens on when that is one address. A page
// of another site that a DNS name pointed at the console (DNS rebinding) sends its
// own name, and is refused.
func consoleHosts(addr net.Addr, listenHost string) []string {
	_, port, _ := net.SplitHostPort(addr.String())
	hosts := []string{addr.String(), net.JoinHostPort("localhost", port), net.JoinHostPort("127.0.0.1", port), net.JoinHostPort("::1", port)}
	if !unspecified(listenHost) {
		hosts = append(hosts, net.JoinHostPort(listenHost, port))
	}
	var out []string
	for _, h := range hosts {
		if !slices.Contains(out, h) {
			out = append(out, h)
		}
	}
	return out
}

// consoleConfig configures the console's handler.
type consoleConfig struct {
	ReadOnly bool
	Logger   *slog.Logger
	// Hosts are the Host headers accepted, port included; Names the host names
	// accepted with any port (--allow-host). Any other Host is refused.
	Hosts, Names []string
	// Token, when set (--allow-remote), is required by every /api/ request:
	// "Authorization: Bearer TOKEN", or the session cookie that POST /api/login
	// sets for it.
	Token string
	// Now is the clock an age (since=1h) is read against; nil is time.Now.
	Now func() time.Time
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
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if len(cfg.Hosts) == 0 && len(cfg.Names) == 0 {
		return nil, errors.New("console: no Host to answer to")
	}
	token, err := randomToken()
	if err != nil {
		return nil, err
	}
	c := &console{admin: a, cfg: cfg, token: token}
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
	c.failuresRoutes(mux)
	if cfg.Token != "" {
		mux.Handle("POST /api/login", http.NewCrossOriginProtection().Handler(http.HandlerFunc(c.login)))
	}
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
		if !c.hostAllowed(r.Host) {
			writeError(w, http.StatusMisdirectedRequest, "bad_host",
				fmt.Sprintf("this console answers to Host %s only", strings.Join(append(slices.Clone(c.cfg.Hosts), c.cfg.Names...), ", ")))
			return
		}
		// The page's own files are the same in every idem binary, and the login
		// takes the token itself; everything else, every read of the database
		// included, needs the token.
		if c.cfg.Token != "" && !publicPaths[r.URL.Path] && !c.authorized(r) {
			c.unauthorized(w)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// publicPaths need no access token in remote mode.
var publicPaths = map[string]bool{"/": true, "/index.html": true, "/app.js": true, "/style.css": true, "/favicon.svg": true, "/api/login": true}

func (c *console) hostAllowed(host string) bool {
	for _, h := range c.cfg.Hosts {
		if strings.EqualFold(h, host) {
			return true
		}
	}
	name := host
	if h, _, err := net.SplitHostPort(host); err == nil {
		name = h
	}
	for _, n := range c.cfg.Names {
		if strings.EqualFold(strings.Trim(n, "[]"), name) {
			return true
		}
	}
	return false
}

// The session cookie that POST /api/login sets: "v1.<issued, unix seconds>.<HMAC-SHA256
// of the issue time, keyed with the access token>". It is HttpOnly (no script
// reads it), SameSite=Strict (no other site's request carries it), and good for
// sessionTTL; changing the token ends every session.
const (
	sessionCookie = "idem_console_session"
	sessionTTL    = 12 * time.Hour
)

func (c *console) sessionValue(issued int64) string {
	mac := hmac.New(sha256.New, []byte(c.cfg.Token))
	fmt.Fprintf(mac, "idem console session v1 %d", issued)
	return "v1." + strconv.FormatInt(issued, 10) + "." + hex.EncodeToString(mac.Sum(nil))
}

func (c *console) validSession(v string) bool {
	version, rest, _ := strings.Cut(v, ".")
	at, _, _ := strings.Cut(rest, ".")
	issued, err := strconv.ParseInt(at, 10, 64)
	if version != "v1" || err != nil {
		return false
	}
	age := time.Since(time.Unix(issued, 0))
	if age > sessionTTL || age < -time.Minute {
		return false
	}
	return hmac.Equal([]byte(c.sessionValue(issued)), []byte(v))
}

// bearer reports whether r carries the access token in its Authorization
// header. The SHA-256 digests are compared, in constant time, so that neither
// the token's bytes nor its length show in the answer's timing.
func (c *console) bearer(r *http.Request) bool {
	got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return false
	}
	a, b := sha256.Sum256([]byte(got)), sha256.Sum256([]byte(c.cfg.Token))
	return subtle.ConstantTimeCompare(a[:], b[:]) == 1
}

// authorized: the access token, or a session cookie made for it.
func (c *console) authorized(r *http.Request) bool {
	if c.bearer(r) {
		return true
	}
	ck, err := r.Cookie(sessionCookie)
	return err == nil && c.validSession(ck.Value)
}

func (c *console) unauthorized(w http.ResponseWriter) {
	w.Header().Set("WWW-Authenticate", `Bearer realm="idem console"`)
	writeError(w, http.StatusUnauthorized, "unauthorized",
		"this console needs its access token: open the URL that idem console printed (http://HOST:PORT/#token=...), "+
			"enter the token on the page, or send \"Authorization: Bearer TOKEN\"")
}

// login trades the access token (Authorization: Bearer) for the session
// cookie, so that the page's requests need not carry the token.
func (c *console) login(w http.ResponseWriter, r *http.Request) {
	if !c.bearer(r) {
		c.unauthorized(w)
		return
	}
	http.SetCookie(w, &http.Cookie{
		Name: sessionCookie, Value: c.sessionValue(time.Now().Unix()), Path: "/",
		MaxAge: int(sessionTTL / time.Second), HttpOnly: true, SameSite: http.SameSiteStrictMode,
		// Behind a TLS proxy the browser speaks HTTPS: keep the cookie to it.
		Secure: r.TLS != nil || strings.EqualFold(r.Header.Get("X-Forwarded-Proto"), "https"),
	})
	w.WriteHeader(http.StatusNoContent)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// writeError answers with RFC 9457 problem details, as httpidem does: the
// stable code in "code" and at the end of "type", the message in "detail".
func writeError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(httpidem.Problem{Type: httpidem.ProblemTypePrefix + code,
		Title: http.StatusText(status), Status: status, Detail: msg, Code: code})
}

// fail answers err with the status its code calls for.
func (c *console) fail(w http.ResponseWriter, r *http.Request, err error) {
	_, code := classify(err)
	status := http.StatusInternalServerError
	switch {
	case errors.Is(err, admin.ErrNotFound):
		status = http.StatusNotFound
	case errors.Is(err, admin.ErrNotDead), errors.Is(err, admin.ErrGroupChanged), errors.Is(err, admin.ErrOffRoute):
		status = http.StatusConflict
	case errors.Is(err, admin.ErrWrongSource), errors.Is(err, admin.ErrNoteRequired):
		status = http.StatusBadRequest
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
	Schema string `json:"schema"`
	// Shards name the shards of a shard map (then Schema is only the default).
	Shards   []string `json:"shards,omitempty"`
	ReadOnly bool     `json:"read_only"`
	Token    string   `json:"token,omitempty"`
	Version  string   `json:"version"`
}

func (c *console) session(w http.ResponseWriter, r *http.Request) {
	s := sessionJSON{Schema: c.admin.Schema(), Shards: c.admin.Shards(), ReadOnly: c.cfg.ReadOnly, Version: buildVersion()}
	if !c.cfg.ReadOnly {
		s.Token = c.token
	}
	writeJSON(w, http.StatusOK, s)
}

func (c *console) stats(w http.ResponseWriter, r *http.Request) {
	// Over a shard map, a shard that does not answer is marked in s.Shards, with
	// the figures of the others: the overview shows which shard is down.
	s, err := c.admin.Stats(r.Context())
	if err != nil && (s == nil || len(s.Shards) == 0) {
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

// inboxPageJSON and effectPageJSON are the console's pages of inbox keys and of
// effects, as its page script reads them.
type (
	inboxPageJSON struct {
		Keys []admin.InboxKey `json:"keys"`
		Next string           `json:"next,omitempty"`
	}
	effectPageJSON struct {
		Effects []admin.Effect `json:"effects"`
		Next    string         `json:"next,omitempty"`
	}
)

func (c *console) effects(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := admin.EffectFilter{Tenant: optional(r, "tenant"), Kind: q.Get("kind"), State: q.Get("state"),
		Stuck: q.Get("stuck") == "1", KeyPrefix: q.Get("prefix"), Consumer: q.Get("consumer")}
	p, err := page(r)
	if err == nil {
		var out *admin.List[admin.Effect]
		if out, err = c.admin.ListEffects(r.Context(), f, p); err == nil {
			writeJSON(w, http.StatusOK, effectPageJSON{Effects: out.Rows, Next: out.Next})
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
		var out *admin.List[admin.InboxKey]
		if out, err = c.admin.ListInbox(r.Context(), f, p); err == nil {
			writeJSON(w, http.StatusOK, inboxPageJSON{Keys: out.Rows, Next: out.Next})
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
	if !c.writable(w, r) {
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
