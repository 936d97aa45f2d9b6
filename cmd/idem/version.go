package main

import (
	"cmp"
	"context"
	"fmt"
	"runtime/debug"

	"github.com/spf13/pflag"
)

var versionCmd = &command{
	name:    "version",
	args:    "[--json]",
	summary: "Print idem's version, the commit it was built from, and the Go version, from the build info",
	example: `idem version
idem --version
idem version --json`,
	offline: true,
	setup: func(fs *pflag.FlagSet) runFunc {
		return func(ctx context.Context, e *env, args []string) error {
			if err := noArgs(args); err != nil {
				return err
			}
			info, ok := debug.ReadBuildInfo()
			if !ok {
				return fmt.Errorf("this binary has no build information (it was not built with module support)")
			}
			v := versionOf(info)
			if e.json {
				return e.writeJSON(v)
			}
			fmt.Fprintf(e.stdout, "idem %s\n", v.Version)
			tw := e.table("  module", v.Module)
			if v.Revision != "" {
				rev := v.Revision
				if v.Modified {
					rev += " (with uncommitted changes)"
				}
				row(tw, "  revision", rev)
			}
			if v.Time != "" {
				row(tw, "  committed", v.Time)
			}
			row(tw, "  go", v.Go)
			return tw.Flush()
		}
	},
}

// versionJSON is what idem version says.
type versionJSON struct {
	Module string `json:"module"`
	// Version is the module version: a release tag for 'go install …@v1.2.3',
	// "(devel)" for a build from a checkout.
	Version string `json:"version"`
	// Revision, Time and Modified come from the VCS stamp, when the build has one
	// (not with -buildvcs=false, nor from 'go run').
	Revision string `json:"revision,omitempty"`
	Time     string `json:"time,omitempty"`
	Modified bool   `json:"modified,omitempty"`
	Go       string `json:"go"`
}

func versionOf(info *debug.BuildInfo) versionJSON {
	v := versionJSON{Module: info.Main.Path, Version: cmp.Or(info.Main.Version, "(devel)"), Go: info.GoVersion}
	for _, s := range info.Settings {
		switch s.Key {
		case "vcs.revision":
			v.Revision = s.Value
		case "vcs.time":
			v.Time = s.Value
		case "vcs.modified":
			v.Modified = s.Value == "true"
		}
	}
	return v
}

// readBuildInfo is versionOf this binary's build info.
func readBuildInfo() (versionJSON, bool) {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return versionJSON{}, false
	}
	return versionOf(info), true
}
