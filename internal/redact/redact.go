package redact

import (
	"errors"
	"net/url"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// Mask stands in for a password.
const Mask = "xxxxx"

var (
	kvPassword     = regexp.MustCompile(`(?i)\b((?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s]*)`)
	urlUserinfo    = regexp.MustCompile(`^([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@?#]*):([^@]*)@`)
	urlQueryPass   = regexp.MustCompile(`(?i)([?&](?:ssl)?password=)[^&]*`)
	queryPasswordK = map[string]bool{"password": true, "sslpassword": true}
)

// DSN returns dsn with its password masked, keeping its shape: a URL stays a URL
// (postgres://user:xxxxx@host:5432/db?sslmode=disable) and key=value stays
// key=value (password=xxxxx). A DSN without a password comes back unchanged.
func DSN(dsn string) string {
	out := structural(dsn)
	for _, p := range passwords(dsn) {
		out = maskAll(out, p)
	}
	return out
}

// Text returns s with every trace of dsn's password masked: the DSN itself where s
// quotes it, and the password wherever it appears, raw, URL-escaped or quoted.
func Text(s, dsn string) string {
	if dsn == "" || s == "" {
		return s
	}
	if strings.Contains(s, dsn) {
		s = strings.ReplaceAll(s, dsn, DSN(dsn))
	}
	for _, p := range passwords(dsn) {
		s = maskAll(s, p)
	}
	return s
}

// Error returns err with its message passed through Text. errors.Is and errors.As
// still see the original chain. A nil err stays nil, and an error with nothing to
// hide is returned as it is.
func Error(err error, dsn string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	if red := Text(msg, dsn); red != msg {
		return &redacted{msg: red, err: err}
	}
	return err
}

type redacted struct {
	msg string
	err error
}

func (e *redacted) Error() string { return e.msg }
func (e *redacted) Unwrap() error { return e.err }

// Is lets errors.Is(redactedErr, original) hold too.
func (e *redacted) Is(target error) bool { return errors.Is(e.err, target) }

// structural masks the password positions of a URL or key=value DSN.
func structural(dsn string) string {
	if isURL(dsn) {
		if u, err := url.Parse(dsn); err == nil {
			if _, has := u.User.Password(); has {
				u.User = url.UserPassword(u.User.Username(), Mask)
			}
			q := u.Query()
			changed := false
			for k := range q {
				if queryPasswordK[strings.ToLower(k)] {
					q.Set(k, Mask)
					changed = true
				}
			}
			if changed {
				u.RawQuery = q.Encode()
			}
			return u.String()
		}
		// Unparsable: mask what looks like userinfo and password parameters.
		dsn = urlUserinfo.ReplaceAllString(dsn, "${1}:"+Mask+"@")
		return urlQueryPass.ReplaceAllString(dsn, "${1}"+Mask)
	}
	return kvPassword.ReplaceAllString(dsn, "${1}"+Mask)
}

// passwords are every password dsn names, as pgx reads it (which includes
// PGPASSWORD) and as the text spells it, with no duplicates or empty strings.
func passwords(dsn string) []string {
	var out []string
	add := func(p string) {
		if p != "" && p != Mask {
			for _, have := range out {
				if have == p {
					return
				}
			}
			out = append(out, p)
		}
	}
	if cfg, err := pgconn.ParseConfig(dsn); err == nil {
		add(cfg.Password)
	}
	if !isURL(dsn) {
		for _, m := range kvPassword.FindAllStringSubmatch(dsn, -1) {
			v := m[2]
			add(v)
			if len(v) >= 2 && v[0] == '\'' && v[len(v)-1] == '\'' {
				add(strings.NewReplacer(`\'`, `'`, `\\`, `\`).Replace(v[1 : len(v)-1]))
			}
		}
		return out
	}
	for _, m := range urlQueryPass.FindAllStringSubmatch(dsn, -1) {
		v := dsn[strings.Index(dsn, m[0])+len(m[1]):]
		if i := strings.IndexByte(v, '&'); i >= 0 {
			v = v[:i]
		}
		add(v)
		if p, err := url.QueryUnescape(v); err == nil {
			add(p)
		}
	}
	if m := urlUserinfo.FindStringSubmatch(dsn); m != nil {
		add(m[2])
		if p, err := url.PathUnescape(m[2]); err == nil {
			add(p)
		}
	}
	if u, err := url.Parse(dsn); err == nil {
		if p, ok := u.User.Password(); ok {
			add(p)
		}
		for k, vs := range u.Query() {
			if queryPasswordK[strings.ToLower(k)] {
				for _, v := range vs {
					add(v)
				}
			}
		}
	}
	return out
}

func isURL(dsn string) bool {
	return strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://")
}

// maskAll replaces p in s, in each spelling a message might quote it in.
func maskAll(s, p string) string {
	for _, form := range []string{p, url.QueryEscape(p), url.PathEscape(p), url.UserPassword("u", p).String()[2:]} {
		if form != "" && strings.Contains(s, form) {
			s = strings.ReplaceAll(s, form, Mask)
		}
	}
	return s
}
