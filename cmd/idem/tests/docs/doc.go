// Package docs holds tests, and nothing else, that keep README.md and the guide in
// docs/ true: every fenced Go block is the text of a Go file that builds (an
// Example function, an example program, or a doc* function in a package's
// example_docs_test.go, compiled by its tests and not run); every page that shows
// Go opens with a whole program under examples/docs/, which
// TestOpeningProgramsRunInABlankModule copies from the page into a blank module,
// builds, runs against the services and checks against the page's text block;
// and every relative link and #anchor resolves. A block marked <!-- fragment: why --> fails the test:
// nothing would compile it.
//
// A Go block is tied to its source by an HTML comment on the line before it,
// which GitHub does not show:
//
//	<!-- snippet: consumer/example_test.go body=Example -->
//	<!-- snippet: effects/example_enqueue_test.go decl=webhookSender,webhookSender.Send -->
//	<!-- snippet: examples/quickstart/main.go -->
//
// body=F is the body of function F, one tab less indented; decl=A,B are the
// declarations A and B (a type, a function, or T.Method), with their doc
// comments, one blank line apart; no selector is the whole file. Paths are from
// the repository's root. Run the tests with -update to rewrite every snippet
// from its source.
package docs
