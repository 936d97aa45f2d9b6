// Package importrules holds only tests: they check, with go list, the direction of
// the imports between idem's packages that docs/architecture/packages.md describes,
// and that its import tables list what each package imports, and fail when one
// breaks.
package importrules
