package canonjson

import (
	"fmt"
	"math/big"
	"strconv"
	"strings"

	"github.com/idemkit/idem/internal/text"
)

func isNumberByte(c byte) bool {
	return c >= '0' && c <= '9' || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E'
}

// canonicalNumber checks tok against the RFC 8259 number grammar
//
//	number = [ "-" ] ( "0" / digit1-9 *DIGIT ) [ "." 1*DIGIT ] [ ("e"/"E") [ "-"/"+" ] 1*DIGIT ]
//
// and writes its exact decimal value the way ECMAScript's Number::toString lays out
// a double (RFC 8785 section 3.2.2.3), with all of the value's significant digits.
func canonicalNumber(tok []byte) (string, error) {
	bad := func() (string, error) { return "", fmt.Errorf("invalid number %s", clipQuoted(string(tok))) }
	i := 0
	neg := false
	if i < len(tok) && tok[i] == '-' {
		neg = true
		i++
	}
	intStart := i
	for i < len(tok) && tok[i] >= '0' && tok[i] <= '9' {
		i++
	}
	intPart := tok[intStart:i]
	if len(intPart) == 0 || len(intPart) > 1 && intPart[0] == '0' {
		return bad()
	}
	var frac []byte
	if i < len(tok) && tok[i] == '.' {
		i++
		start := i
		for i < len(tok) && tok[i] >= '0' && tok[i] <= '9' {
			i++
		}
		if frac = tok[start:i]; len(frac) == 0 {
			return bad()
		}
	}
	var expNeg bool
	var expDigits []byte
	if i < len(tok) && (tok[i] == 'e' || tok[i] == 'E') {
		i++
		if i < len(tok) && (tok[i] == '+' || tok[i] == '-') {
			expNeg = tok[i] == '-'
			i++
		}
		start := i
		for i < len(tok) && tok[i] >= '0' && tok[i] <= '9' {
			i++
		}
		if expDigits = tok[start:i]; len(expDigits) == 0 {
			return bad()
		}
	}
	if i != len(tok) {
		return bad()
	}

	// The value is digits × 10^(exp − len(frac)), digits = intPart ‖ frac.
	digits := make([]byte, 0, len(intPart)+len(frac))
	digits = append(digits, intPart...)
	digits = append(digits, frac...)
	lead := 0
	for lead < len(digits) && digits[lead] == '0' {
		lead++
	}
	digits = digits[lead:]
	if len(digits) == 0 {
		return "0", nil // 0, -0, 0.000, 0e7: all zero
	}
	trail := 0
	for digits[len(digits)-1-trail] == '0' {
		trail++
	}
	digits = digits[:len(digits)-trail]
	for len(expDigits) > 1 && expDigits[0] == '0' {
		expDigits = expDigits[1:]
	}

	// n is ECMAScript's n: the value is 0.d1d2…dk × 10^n.
	k := int64(len(digits))
	shift := k + int64(trail) - int64(len(frac))
	var out []byte
	if neg {
		out = append(out, '-')
	}
	if len(expDigits) > 15 {
		// |exponent| > 10^15 dwarfs every length, so the layout is exponential;
		// the exponent is computed exactly with big integers.
		e, _ := new(big.Int).SetString(string(expDigits), 10)
		if expNeg {
			e.Neg(e)
		}
		e.Add(e, big.NewInt(shift-1))
		return string(appendExponential(out, digits, e.String())), nil
	}
	exp, _ := strconv.ParseInt(string(expDigits), 10, 64) // "" parses as an error and 0
	if expNeg {
		exp = -exp
	}
	n := exp + shift
	switch {
	case k <= n && n <= 21: // an integer: the digits, then zeros
		out = append(out, digits...)
		for range n - k {
			out = append(out, '0')
		}
	case 0 < n && n <= 21: // a point inside the digits
		out = append(out, digits[:n]...)
		out = append(out, '.')
		out = append(out, digits[n:]...)
	case -6 < n && n <= 0: // 0.000ddd
		out = append(out, '0', '.')
		for range -n {
			out = append(out, '0')
		}
		out = append(out, digits...)
	default:
		e := n - 1
		sign := "+"
		if e < 0 {
			sign = ""
		}
		out = appendExponential(out, digits, sign+strconv.FormatInt(e, 10))
	}
	return string(out), nil
}

// appendExponential writes d1[.d2…dk]e±exp; exp has its sign unless positive.
func appendExponential(out, digits []byte, exp string) []byte {
	out = append(out, digits[0])
	if len(digits) > 1 {
		out = append(out, '.')
		out = append(out, digits[1:]...)
	}
	out = append(out, 'e')
	if exp[0] != '-' && exp[0] != '+' {
		out = append(out, '+')
	}
	return append(out, exp...)
}

// clipQuoted quotes s for an error message, cut to 32 bytes at a character
// boundary: payloads reach logs.
func clipQuoted(s string) string {
	if len(s) > 32 {
		return strconv.Quote(strings.TrimSuffix(text.Clip(s, 32), "…")) + "…"
	}
	return strconv.Quote(s)
}
