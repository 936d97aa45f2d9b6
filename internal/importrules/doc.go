// Package importrules holds only a test: it checks, with go list, the direction of
// the imports between idem's packages that docs/architecture/packages.md describes, and
// fails when one breaks.
package importrules
