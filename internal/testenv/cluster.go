package testenv

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Cluster is a RabbitMQ cluster of its own, for one test: nodes started
// on this machine as the rabbitmq user, each with its own node name,
// ports, data and log folders, joined to each other and never to the
// machine's own broker. Its default virtual host is the test's alone.
type Cluster struct {
	Nodes []*ClusterNode
}

// ClusterNode is one node of a Cluster.
type ClusterNode struct {
	// Name is its Erlang node name, name@localhost.
	Name string
	// URL connects to it as guest, on 127.0.0.1.
	URL     string
	address string // host:port of its listener
	dir     string
	env     []string // of rabbitmq-server: its ports and folders
}

// URL lists every node's URL, comma-separated, as AMQP_URL takes them.
func (c *Cluster) URL() string {
	urls := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		urls[i] = n.URL
	}
	return strings.Join(urls, ",")
}

// clusterNodeBoot bounds how long a node takes to start.
const clusterNodeBoot = 2 * time.Minute

// NewCluster starts a cluster of n nodes and returns once they are joined;
// they are stopped and their folders removed when the test ends. It skips
// the test where rabbitmq-server or the rabbitmq user is missing, or the
// test does not run as root (which starting nodes as that user takes).
func NewCluster(t *testing.T, n int) *Cluster {
	t.Helper()
	if _, err := exec.LookPath("rabbitmq-server"); err != nil {
		t.Skip("a RabbitMQ cluster test: rabbitmq-server is not installed here (.ci/run has it)")
	}
	if _, err := user.Lookup("rabbitmq"); err != nil || os.Geteuid() != 0 {
		t.Skip("a RabbitMQ cluster test: starting nodes takes root and a rabbitmq user (.ci/run has both)")
	}
	c := &Cluster{}
	prefix := "it" + strings.ReplaceAll(uniqueName(), "_", "")
	for i := range n {
		node := startClusterNode(t, fmt.Sprintf("%s%d", prefix, i+1))
		c.Nodes = append(c.Nodes, node)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i, node := range c.Nodes {
		wg.Go(func() { errs[i] = node.awaitStartup() })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	for _, node := range c.Nodes[1:] {
		require.NoError(t, node.ctl("stop_app"))
		require.NoError(t, node.ctl("join_cluster", c.Nodes[0].Name))
		require.NoError(t, node.ctl("start_app"))
	}
	return c
}

// startClusterNode starts a node named name@localhost, detached, with its
// listener on a free port of 127.0.0.1 and one plugin, the consistent-hash
// exchange (partitioned ingest).
func startClusterNode(t *testing.T, name string) *ClusterNode {
	t.Helper()
	dir, err := os.MkdirTemp("", "inboxd-"+name+"-")
	require.NoError(t, err)
	port, dist := freePort(t), freePort(t)
	conf := fmt.Sprintf("listeners.tcp.default = 127.0.0.1:%d\n", port)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "rabbitmq.conf"), []byte(conf), 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "enabled_plugins"), []byte("[rabbitmq_consistent_hash_exchange].\n"), 0o644))
	require.NoError(t, exec.Command("chown", "-R", "rabbitmq", dir).Run())
	node := &ClusterNode{
		Name:    name + "@localhost",
		URL:     fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", port),
		address: fmt.Sprintf("127.0.0.1:%d", port),
		dir:     dir,
	}
	node.env = []string{
		"RABBITMQ_NODE_PORT=" + strconv.Itoa(port),
		"RABBITMQ_DIST_PORT=" + strconv.Itoa(dist),
		"RABBITMQ_CONFIG_FILE=" + filepath.Join(dir, "rabbitmq.conf"),
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(dir, "enabled_plugins"),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(dir, "mnesia"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(dir, "log"),
		"RABBITMQ_PID_FILE=" + filepath.Join(dir, "pid"),
	}
	node.start(t)
	t.Cleanup(func() {
		node.Kill(t)
		_ = os.RemoveAll(dir)
	})
	return node
}

// start runs rabbitmq-server detached for the node.
func (n *ClusterNode) start(t *testing.T) {
	t.Helper()
	cmd := n.command(context.Background(), "rabbitmq-server", "-detached")
	cmd.Env = append(cmd.Env, n.env...)
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "start node %s: %s", n.Name, out)
}

// Restart starts a killed node again, with its data, and waits until it
// runs: it rejoins the cluster, and its quorum queue replicas catch up.
func (n *ClusterNode) Restart(t *testing.T) {
	t.Helper()
	n.start(t)
	require.NoError(t, n.awaitStartup())
}

// Leaders returns the node each queue of the default virtual host has its
// leader on (a classic queue's own node), asking the first node that
// answers.
func (c *Cluster) Leaders(t *testing.T) map[string]*ClusterNode {
	t.Helper()
	var out string
	var err error
	for _, n := range c.Nodes {
		if out, err = n.ctlOutput("list_queues", "-q", "--no-table-headers", "name", "leader", "pid"); err == nil {
			break
		}
	}
	require.NoError(t, err)
	leaders := map[string]*ClusterNode{}
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		fields := strings.Split(line, "\t")
		if len(fields) < 3 {
			continue
		}
		node := fields[1]
		if node == "" {
			// A pid reads <name@host.N.N.N>.
			node, _, _ = strings.Cut(strings.TrimPrefix(fields[2], "<"), ".")
		}
		for _, n := range c.Nodes {
			if n.Name == node {
				leaders[fields[0]] = n
			}
		}
	}
	return leaders
}

// awaitStartup waits for the node to be up. rabbitmqctl await_startup
// fails at once while the node has not registered with epmd yet, so it is
// tried again until clusterNodeBoot has passed.
func (n *ClusterNode) awaitStartup() error {
	deadline := time.Now().Add(clusterNodeBoot)
	for {
		err := n.ctl("await_startup", "--timeout", "60")
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%w\n%s", err, n.logTail())
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// logTail returns the end of the node's log, or says it wrote none (as a
// node does that dies while booting, its distribution port taken).
func (n *ClusterNode) logTail() string {
	logs, _ := filepath.Glob(filepath.Join(n.dir, "log", "*.log"))
	var b strings.Builder
	for _, name := range logs {
		text, err := os.ReadFile(name)
		if err != nil {
			continue
		}
		lines := strings.Split(strings.TrimSpace(string(text)), "\n")
		fmt.Fprintf(&b, "the end of %s:\n%s\n", filepath.Base(name), strings.Join(lines[max(0, len(lines)-30):], "\n"))
	}
	if b.Len() == 0 {
		return fmt.Sprintf("node %s wrote no log in %s", n.Name, n.dir)
	}
	return b.String()
}

// command runs name as the rabbitmq user, addressed to this node.
func (n *ClusterNode) command(ctx context.Context, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "runuser", append([]string{"-u", "rabbitmq", "--", name}, args...)...)
	cmd.Env = []string{
		"HOME=/var/lib/rabbitmq",
		"PATH=" + os.Getenv("PATH"),
		"RABBITMQ_NODENAME=" + n.Name,
	}
	return cmd
}

// ctl runs rabbitmqctl against the node.
func (n *ClusterNode) ctl(args ...string) error {
	_, err := n.ctlOutput(args...)
	return err
}

// ctlOutput runs rabbitmqctl against the node and returns its output.
func (n *ClusterNode) ctlOutput(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), clusterNodeBoot)
	defer cancel()
	var out, errOut bytes.Buffer
	cmd := n.command(ctx, "rabbitmqctl", append([]string{"-n", n.Name}, args...)...)
	cmd.Stdout, cmd.Stderr = &out, &errOut
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("rabbitmqctl %s on %s: %w: %s%s", strings.Join(args, " "), n.Name, err, out.String(), errOut.String())
	}
	return out.String(), nil
}

// NodeOf returns the node that holds a client connection whose
// connection_name is, asking the first node that answers, or nil when
// none does.
func (c *Cluster) NodeOf(t *testing.T, is func(connectionName string) bool) *ClusterNode {
	t.Helper()
	var out string
	var err error
	for _, n := range c.Nodes {
		if out, err = n.ctlOutput("list_connections", "-q", "--no-table-headers", "name", "client_properties"); err == nil {
			break
		}
	}
	require.NoError(t, err)
	for _, line := range strings.Split(out, "\n") {
		// A connection's name is "<client address> -> <node address>".
		_, rest, ok := strings.Cut(line, " -> ")
		name := connectionName.FindStringSubmatch(line)
		if !ok || name == nil || !is(name[1]) {
			continue
		}
		for _, n := range c.Nodes {
			if strings.HasPrefix(rest, n.address+"\t") {
				return n
			}
		}
	}
	return nil
}

// connectionName finds a connection's connection_name in its client
// properties as rabbitmqctl prints them.
var connectionName = regexp.MustCompile(`"connection_name","([^"]*)"`)

// Kill ends the node with SIGKILL, as a lost machine would, if it runs.
func (n *ClusterNode) Kill(t *testing.T) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(n.dir, "pid"))
	if err != nil {
		return
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGKILL)
	for range 100 {
		if syscall.Kill(pid, 0) != nil {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}
