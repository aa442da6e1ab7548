package main

import (
	"bytes"
	"encoding/binary"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// pgProxy sits between inboxd and PostgreSQL and drops the connection around
// some COMMITs and ingest INSERTs, so that their outcome is unknown to the
// client: either before forwarding the statement (it never ran) or after the
// server had time to run it but before its answer is forwarded (it did).
// The client must use the simple query protocol (default_query_exec_mode=
// simple_protocol), so each statement crosses the proxy as one 'Q' message.
type pgProxy struct {
	ln     net.Listener
	target string
	every  int64 // drop around one in every matching statements

	matched       atomic.Int64
	droppedBefore atomic.Int64
	droppedAfter  atomic.Int64

	mu    sync.Mutex
	conns []net.Conn
}

func startPGProxy(t *testing.T, target string, every int64) *pgProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &pgProxy{ln: ln, target: target, every: every}
	go p.accept()
	t.Cleanup(p.stop)
	return p
}

func (p *pgProxy) addr() string { return p.ln.Addr().String() }

// stop makes PostgreSQL unreachable through the proxy: it refuses new
// connections and cuts the open ones.
func (p *pgProxy) stop() {
	_ = p.ln.Close()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
}

func (p *pgProxy) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			_ = client.Close()
			continue
		}
		p.mu.Lock()
		p.conns = append(p.conns, client, server)
		p.mu.Unlock()
		go p.pipe(client, server)
	}
}

// pipe forwards server→client as is, and client→server message by message.
func (p *pgProxy) pipe(client, server net.Conn) {
	defer client.Close()
	defer server.Close()
	// serverToClient is stopped (by closing) to hold back an answer.
	go func() {
		_, _ = io.Copy(client, server)
		_ = client.Close()
	}()

	// The startup message has no type byte.
	var lenBuf [4]byte
	if _, err := io.ReadFull(client, lenBuf[:]); err != nil {
		return
	}
	startup := make([]byte, binary.BigEndian.Uint32(lenBuf[:])-4)
	if _, err := io.ReadFull(client, startup); err != nil {
		return
	}
	if _, err := server.Write(append(lenBuf[:], startup...)); err != nil {
		return
	}
	for {
		var head [5]byte
		if _, err := io.ReadFull(client, head[:]); err != nil {
			return
		}
		body := make([]byte, binary.BigEndian.Uint32(head[1:])-4)
		if _, err := io.ReadFull(client, body); err != nil {
			return
		}
		msg := append(head[:], body...)
		if head[0] == 'Q' && p.matches(body) {
			n := p.matched.Add(1)
			if n%p.every == 0 {
				if (n/p.every)%2 == 0 {
					p.droppedBefore.Add(1)
					return // never forwarded: the statement does not run
				}
				p.droppedAfter.Add(1)
				_, _ = server.Write(msg)
				// Cut the client off before the answer can reach it.
				_ = client.Close()
				time.Sleep(50 * time.Millisecond) // the server runs (and commits) the statement meanwhile
				return
			}
		}
		if _, err := server.Write(msg); err != nil {
			return
		}
	}
}

func (p *pgProxy) matches(query []byte) bool {
	q := strings.ToLower(string(bytes.TrimRight(query, "\x00")))
	return strings.HasPrefix(strings.TrimSpace(q), "commit") || strings.Contains(q, "insert into inbox")
}
