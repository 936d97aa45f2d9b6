// Package modules holds tests, and nothing else, that keep the repository's Go
// modules apart: the library module (the repository's root) needs none of the
// tools' dependencies (a browser driver, migration tools, a dashboard SDK, an SMTP
// library) and none of the adapters' (a broker client, an embedded or test
// broker), and go.work and the README's test command name every module.
package modules
