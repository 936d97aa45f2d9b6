package main

import (
	"cmp"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/idemkit/idem/admin"
)

// The console's Failures page: the failure groups of the admin API, one group's
// detail, and its repair actions (retry or discard for dead effects, release for
// failed inbox keys), each shown first as its dry run and taken only with a note.

func (c *console) failuresRoutes(mux *http.ServeMux) {
	mux.HandleFunc("GET /api/failures", c.failureGroups)
	mux.HandleFunc("GET /api/failures/group", c.failureGroup)
	mux.Handle("POST /api/failures/action", http.NewCrossOriginProtection().Handler(http.HandlerFunc(c.failureAction)))
	mux.HandleFunc("GET /api/activity", c.activity)
}

// activityWindows are the overview's charts: per minute, over the last hour or day.
var activityWindows = map[string]time.Duration{"hour": time.Hour, "day": 24 * time.Hour}

// activity answers the per-minute activity of the overview's charts.
func (c *console) activity(w http.ResponseWriter, r *http.Request) {
	name := cmp.Or(r.URL.Query().Get("window"), "hour")
	window, ok := activityWindows[name]
	if !ok {
		writeError(w, http.StatusBadRequest, "bad_filter", fmt.Sprintf("window %q: use hour or day", clip(name, 20)))
		return
	}
	a, err := c.admin.Activity(r.Context(), window)
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, a)
}

// groupPageJSON is a page of failure groups, with the window it counted as
// absolute times: the page's More sends them back, so that the next page counts
// the same window when it was given as an age (since=1h).
type groupPageJSON struct {
	Groups []admin.FailureGroup `json:"groups"`
	Next   string               `json:"next,omitempty"`
	Since  time.Time            `json:"since,omitzero"`
	Until  time.Time            `json:"until,omitzero"`
}

// failureGroups answers a page of failure groups: source, consumer, kind, tenant
// (absent: every tenant; empty: the unscoped one), code (an error code, exact),
// since and until (a time, a date or an age such as 1h or 7d, as the CLI's flags
// take) and order, as admin.GroupFilter has them.
func (c *console) failureGroups(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	f := admin.GroupFilter{Source: q.Get("source"), Consumer: q.Get("consumer"), Kind: q.Get("kind"),
		Tenant: optional(r, "tenant"), Code: q.Get("code"), Order: q.Get("order")}
	p, err := page(r)
	if err == nil {
		f.Seen, err = seenRange(r, c.cfg.Now())
	}
	if err == nil {
		var out *admin.List[admin.FailureGroup]
		if out, err = c.admin.ListGroups(r.Context(), f, p); err == nil {
			writeJSON(w, http.StatusOK, groupPageJSON{Groups: out.Rows, Next: out.Next, Since: f.Seen.Since, Until: f.Seen.Until})
			return
		}
	}
	c.fail(w, r, err)
}

// seenRange reads the since and until parameters of a failure group list, an
// age (1h) as that long before now.
func seenRange(r *http.Request, now time.Time) (admin.TimeRange, error) {
	var tr admin.TimeRange
	for _, p := range []struct {
		name string
		t    *time.Time
	}{{"since", &tr.Since}, {"until", &tr.Until}} {
		if s := r.URL.Query().Get(p.name); s != "" {
			v := &timeValue{t: p.t}
			if err := v.Set(s); err != nil {
				return tr, codedf(admin.ErrBadFilter, "%s %s", p.name, clip(err.Error(), 200))
			}
			v.resolve(now)
		}
	}
	return tr, nil
}

// failureGroup answers one group. A group that holds no failures now but has
// actions on it (it was retried, discarded or released) answers with a count of
// 0 and those actions, so the page can show what became of it.
func (c *console) failureGroup(w http.ResponseWriter, r *http.Request) {
	id := r.URL.Query().Get("id")
	g, err := c.admin.Group(r.Context(), id, admin.TimeRange{})
	if errors.Is(err, admin.ErrNotFound) {
		acts, aerr := c.admin.ListActions(r.Context(), admin.ActionFilter{Group: id}, admin.Page{Limit: 20})
		if aerr == nil && len(acts.Rows) > 0 {
			last := acts.Rows[0]
			out := admin.FailureGroup{ID: id, Source: last.Source, Tenant: last.Tenant, SampleKeys: []string{}, Actions: acts.Rows}
			if last.Source == admin.SourceInbox {
				out.Consumer = last.Place
			} else {
				out.Kind = last.Place
			}
			writeJSON(w, http.StatusOK, out)
			return
		}
	}
	if err != nil {
		c.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, g)
}

// failureActionRequest is the body of POST /api/failures/action. Through is the
// group's last failure as the page showed it; AtMost the rows of the dry run the
// operator confirmed.
type failureActionRequest struct {
	ID      string    `json:"id"`
	Action  string    `json:"action"`
	Since   time.Time `json:"since,omitzero"`
	Through time.Time `json:"through"`
	DryRun  bool      `json:"dry_run"`
	AtMost  int64     `json:"at_most"`
	Who     string    `json:"who"`
	Why     string    `json:"why"`
}

func (c *console) failureAction(w http.ResponseWriter, r *http.Request) {
	if !c.writable(w, r) {
		return
	}
	var req failureActionRequest
	dec := json.NewDecoder(io.LimitReader(r.Body, 64<<10))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil || req.ID == "" {
		writeError(w, http.StatusBadRequest, "bad_request", `send {"id": "…", "action": "retry|discard|release", "through": "…", "dry_run": true|false, "at_most": N, "who": "…", "why": "…"}`)
		return
	}
	fa, ok := failureActionFor(req.Action)
	if !ok {
		writeError(w, http.StatusBadRequest, "bad_request", fmt.Sprintf("action %q: use retry, discard or release", clip(req.Action, 20)))
		return
	}
	// The audit names the console and the client's address besides the name the
	// operator typed.
	host, _, _ := net.SplitHostPort(r.RemoteAddr)
	who := cmp.Or(strings.TrimSpace(req.Who), "unknown") + " (console, " + cmp.Or(host, r.RemoteAddr) + ")"
	res, err := fa.do(c.admin, r.Context(), admin.GroupAction{ID: req.ID, Since: req.Since, Through: req.Through,
		DryRun: req.DryRun, AtMost: req.AtMost, Note: admin.Audit{Who: who, Why: req.Why}})
	if err != nil {
		c.fail(w, r, err)
		return
	}
	if !req.DryRun {
		c.cfg.Logger.Info("idem console: failure group "+req.Action, slog.String("schema", c.admin.Schema()),
			slog.String("group", req.ID), slog.Int64("rows", res.Rows), slog.String("who", who),
			slog.String("why", req.Why), slog.String("remote", r.RemoteAddr))
	}
	writeJSON(w, http.StatusOK, res)
}

// writable answers a request that would change something and reports whether it
// may go on: not on a read-only console, and only with the page's token (the
// CSRF check besides Go's cross-origin protection).
func (c *console) writable(w http.ResponseWriter, r *http.Request) bool {
	if c.cfg.ReadOnly {
		writeError(w, http.StatusForbidden, "read_only", "this console is read-only (--read-only): it changes nothing")
		return false
	}
	if subtle.ConstantTimeCompare([]byte(r.Header.Get(tokenHeader)), []byte(c.token)) != 1 {
		writeError(w, http.StatusForbidden, "bad_token", "missing or wrong "+tokenHeader+" header: reload the page")
		return false
	}
	return true
}
