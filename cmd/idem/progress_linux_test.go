package main

import (
	"errors"
	"io"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// openPTY opens a pseudo-terminal: its controlling side, and the terminal a
// program writes to.
func openPTY(t *testing.T) (control, tty *os.File) {
	t.Helper()
	control, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = control.Close() })
	var unlock int32
	_, _, errno := syscall.Syscall(syscall.SYS_IOCTL, control.Fd(), syscall.TIOCSPTLCK, uintptr(unsafe.Pointer(&unlock)))
	require.Zero(t, errno)
	var n uint32
	_, _, errno = syscall.Syscall(syscall.SYS_IOCTL, control.Fd(), syscall.TIOCGPTN, uintptr(unsafe.Pointer(&n)))
	require.Zero(t, errno)
	tty, err = os.OpenFile("/dev/pts/"+strconv.Itoa(int(n)), os.O_RDWR|syscall.O_NOCTTY, 0)
	require.NoError(t, err)
	return control, tty
}

// On a terminal the bar is drawn: frames that start with \r, redrawn in place,
// and a newline at the end.
func TestProgressOnATerminalDrawsFrames(t *testing.T) {
	t.Parallel()
	control, tty := openPTY(t)
	clock := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	p := newProgress(tty, func() time.Time { return clock })
	require.True(t, p.terminal)
	p.show(0, "starting")
	clock = clock.Add(time.Second)
	p.show(0.5, "half")
	p.end("done")
	require.NoError(t, tty.Close())
	out, err := io.ReadAll(control)
	var pathErr *os.PathError
	if !errors.As(err, &pathErr) || !errors.Is(err, syscall.EIO) { // EIO: the terminal's side is closed
		require.NoError(t, err)
	}
	// The terminal turns \n into \r\n.
	frame1 := "[" + strings.Repeat(".", 30) + "] starting"
	frame2 := "[" + strings.Repeat("#", 15) + strings.Repeat(".", 15) + "] half"
	require.Equal(t, "\r"+frame1+"\r"+frame2+"    "+"\rdone"+strings.Repeat(" ", len(frame2)-4)+"\r\n", string(out))
}
