//go:build !race

// Not built with the race detector: these tests read manifests, with
// nothing concurrent for it to watch, and the Kubernetes API types
// (k8s.io/api) would be compiled a second time, instrumented, for the race
// run (make test-race) alone.

package main

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

// kubernetesDir holds the Kubernetes manifests.
const kubernetesDir = "../../deploy/kubernetes"

// kustomization is the part of kustomize's Kustomization the manifests
// use; a field it does not list fails the strict decoding, so a new one is
// added here first.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Namespace  string   `json:"namespace"`
	Resources  []string `json:"resources"`
}

// kubeManifests is deploy/kubernetes, decoded.
type kubeManifests struct {
	kustomization kustomization
	// resources are the objects of the files kustomization.yaml lists.
	resources  []runtime.Object
	deployment *appsv1.Deployment
	job        *batchv1.Job
	service    *corev1.Service
	pdb        *policyv1.PodDisruptionBudget
	configMaps map[string]*corev1.ConfigMap
	// exampleSecrets are the Secrets of the *.example.yaml files.
	exampleSecrets []*corev1.Secret
	// image is the environment and user the Dockerfile's image runs with.
	image dockerImage
}

// loadKubeManifests decodes every YAML document of deploy/kubernetes
// strictly, as the API server would: each into the k8s.io/api type its
// apiVersion and kind name, failing on a kind it does not know, an unknown
// or misspelt field (case counts) and a duplicate one.
func loadKubeManifests(t *testing.T) *kubeManifests {
	t.Helper()
	scheme := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, appsv1.AddToScheme, batchv1.AddToScheme, policyv1.AddToScheme} {
		require.NoError(t, add(scheme))
	}
	decoder := serializer.NewCodecFactory(scheme, serializer.EnableStrict).UniversalDeserializer()

	m := &kubeManifests{configMaps: map[string]*corev1.ConfigMap{}, image: readDockerImage(t)}
	raw, err := os.ReadFile(filepath.Join(kubernetesDir, "kustomization.yaml"))
	require.NoError(t, err)
	js, err := yaml.YAMLToJSONStrict(raw)
	require.NoError(t, err, "kustomization.yaml")
	strictErrs, err := kjson.UnmarshalStrict(js, &m.kustomization)
	require.NoError(t, errors.Join(append(strictErrs, err)...), "kustomization.yaml")
	require.Equal(t, "kustomize.config.k8s.io/v1beta1", m.kustomization.APIVersion)
	require.Equal(t, "Kustomization", m.kustomization.Kind)

	files, err := filepath.Glob(filepath.Join(kubernetesDir, "*.y*ml"))
	require.NoError(t, err)
	var listed []string
	for _, path := range files {
		name := filepath.Base(path)
		if name == "kustomization.yaml" {
			continue
		}
		example := strings.HasSuffix(name, ".example.yaml")
		if !example {
			listed = append(listed, name)
		}
		for _, obj := range decodeYAMLFile(t, path, decoder) {
			if example {
				secret, ok := obj.(*corev1.Secret)
				require.True(t, ok, "%s: an example file holds Secrets only, not %T", name, obj)
				m.exampleSecrets = append(m.exampleSecrets, secret)
				continue
			}
			m.resources = append(m.resources, obj)
			switch o := obj.(type) {
			case *appsv1.Deployment:
				require.Nil(t, m.deployment, "%s: one Deployment", name)
				m.deployment = o
			case *batchv1.Job:
				require.Nil(t, m.job, "%s: one Job", name)
				m.job = o
			case *corev1.Service:
				require.Nil(t, m.service, "%s: one Service", name)
				m.service = o
			case *policyv1.PodDisruptionBudget:
				require.Nil(t, m.pdb, "%s: one PodDisruptionBudget", name)
				m.pdb = o
			case *corev1.ConfigMap:
				m.configMaps[o.Name] = o
			case *corev1.Namespace:
			case *corev1.Secret:
				t.Fatalf("%s: the Secret %s holds values; keep Secrets out of the manifests (an example goes in a *.example.yaml file)", name, o.Name)
			default:
				t.Fatalf("%s: %T is not checked here; add a check for it", name, obj)
			}
		}
	}
	// Exactly the manifests are applied: none forgotten, no example.
	require.ElementsMatch(t, listed, m.kustomization.Resources, "kustomization.yaml's resources are the manifests of deploy/kubernetes, without the *.example.yaml files")
	require.NotNil(t, m.deployment, "a Deployment")
	require.NotNil(t, m.job, "a Job")
	require.NotNil(t, m.service, "a Service")
	require.NotNil(t, m.pdb, "a PodDisruptionBudget")
	require.NotEmpty(t, m.exampleSecrets, "secrets.example.yaml")
	return m
}

// decodeYAMLFile decodes each document of the YAML file at path.
func decodeYAMLFile(t *testing.T, path string, decoder runtime.Decoder) []runtime.Object {
	t.Helper()
	raw, err := os.ReadFile(path)
	require.NoError(t, err)
	reader := k8syaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(raw)))
	var objs []runtime.Object
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, path)
		if len(bytes.TrimSpace(stripYAMLComments(doc))) == 0 {
			continue
		}
		obj, _, err := decoder.Decode(doc, nil, nil)
		require.NoError(t, err, "%s: a document does not decode strictly", filepath.Base(path))
		objs = append(objs, obj)
	}
	require.NotEmpty(t, objs, path)
	return objs
}

// stripYAMLComments drops the comment lines of doc.
func stripYAMLComments(doc []byte) []byte {
	var out []byte
	for line := range bytes.Lines(doc) {
		if !bytes.HasPrefix(bytes.TrimSpace(line), []byte("#")) {
			out = append(out, line...)
		}
	}
	return out
}

// dockerImage is what the Dockerfile's last stage gives a container: its
// environment (ENV) and its user (USER, uid and gid).
type dockerImage struct {
	env      map[string]string
	uid, gid int64
}

// readDockerImage reads ENV and USER of the Dockerfile's last stage. It
// reads the one-line forms the Dockerfile uses (ENV key=value ..., USER
// uid:gid) and fails on the others.
func readDockerImage(t *testing.T) dockerImage {
	t.Helper()
	raw, err := os.ReadFile("../../Dockerfile")
	require.NoError(t, err)
	img := dockerImage{env: map[string]string{}, uid: -1, gid: -1}
	for line := range strings.Lines(string(raw)) {
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		switch strings.ToUpper(fields[0]) {
		case "FROM":
			img = dockerImage{env: map[string]string{}, uid: -1, gid: -1}
		case "ENV":
			for _, kv := range fields[1:] {
				k, v, ok := strings.Cut(kv, "=")
				require.True(t, ok, "Dockerfile: %q: write ENV key=value", strings.TrimSpace(line))
				img.env[k] = strings.Trim(v, `"`)
			}
		case "USER":
			require.Len(t, fields, 2, "Dockerfile: %q", strings.TrimSpace(line))
			uid, gid, _ := strings.Cut(fields[1], ":")
			img.uid, err = strconv.ParseInt(uid, 10, 64)
			require.NoError(t, err, "Dockerfile: USER is a number, so that runAsNonRoot can verify it")
			img.gid, err = strconv.ParseInt(gid, 10, 64)
			require.NoError(t, err, "Dockerfile: USER has a numeric group")
		}
	}
	return img
}

// secretPlaceholders stand for the values of the settings a pod takes
// from Secrets: values of the right form, for loadConfig.
var secretPlaceholders = map[string]string{
	"DATABASE_URL": "postgres://placeholder:placeholder@postgres.invalid:5432/inbox",
	"AMQP_URL":     "amqp://placeholder:placeholder@rabbitmq.invalid:5672/",
}

// podEnv is the environment container c of a pod gets, by precedence:
// the image's ENV, then envFrom's ConfigMaps, then env. A value from a
// Secret is its placeholder. It fails on references the test cannot
// follow (a prefix, a Secret by envFrom, a field reference).
func (m *kubeManifests) podEnv(t *testing.T, c corev1.Container) map[string]string {
	t.Helper()
	env := map[string]string{}
	for k, v := range m.image.env {
		env[k] = v
	}
	for _, from := range c.EnvFrom {
		require.Empty(t, from.Prefix, "%s: envFrom without a prefix", c.Name)
		require.Nil(t, from.SecretRef, "%s: a Secret by secretKeyRef, one variable each, not by envFrom", c.Name)
		require.NotNil(t, from.ConfigMapRef, "%s: envFrom a ConfigMap", c.Name)
		cm, ok := m.configMaps[from.ConfigMapRef.Name]
		require.True(t, ok, "%s: envFrom the ConfigMap %s, which the manifests do not have", c.Name, from.ConfigMapRef.Name)
		for k, v := range cm.Data {
			env[k] = v
		}
	}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = e.Value
		case e.ValueFrom.SecretKeyRef != nil:
			v, ok := secretPlaceholders[e.Name]
			require.True(t, ok, "%s: %s comes from a Secret; give it a placeholder in secretPlaceholders", c.Name, e.Name)
			env[e.Name] = v
		default:
			t.Fatalf("%s: %s comes from neither a value nor a Secret", c.Name, e.Name)
		}
	}
	return env
}

// onlyContainer returns the pod's one container.
func onlyContainer(t *testing.T, spec corev1.PodSpec) corev1.Container {
	t.Helper()
	require.Len(t, spec.Containers, 1)
	require.Empty(t, spec.InitContainers)
	return spec.Containers[0]
}

// containerPort resolves a probe's or a Service's port, by name or number,
// to a port of c.
func containerPort(t *testing.T, c corev1.Container, name string, number int32) int32 {
	t.Helper()
	for _, p := range c.Ports {
		if name != "" && p.Name == name || name == "" && p.ContainerPort == number {
			return p.ContainerPort
		}
	}
	t.Fatalf("%s has no port %q (%d)", c.Name, name, number)
	return 0
}

// The manifests of deploy/kubernetes decode strictly into Kubernetes' own
// types, and say what the code does: the probes' paths and port, the
// commands, the settings, the user and grace period of the image.
func TestKubernetesManifests(t *testing.T) {
	t.Parallel()
	m := loadKubeManifests(t)
	serve := onlyContainer(t, m.deployment.Spec.Template.Spec)
	migrate := onlyContainer(t, m.job.Spec.Template.Spec)
	pods := map[string]corev1.PodSpec{"Deployment": m.deployment.Spec.Template.Spec, "Job": m.job.Spec.Template.Spec}

	t.Run("CommandsAreInboxds", func(t *testing.T) {
		t.Parallel()
		// The image's ENTRYPOINT runs inboxd; args name the command.
		for command, c := range map[string]corev1.Container{"migrate": migrate, "serve": serve} {
			require.Empty(t, c.Command, "%s: keep the image's entrypoint, inboxd", c.Name)
			require.Equal(t, []string{command}, c.Args, c.Name)
			// inboxd knows the command: it gets as far as the configuration.
			err := run(t.Context(), c.Args, func(string) string { return "" }, io.Discard, io.Discard)
			require.NotErrorIs(t, err, errUsage, "%s: inboxd %s", c.Name, command)
			require.ErrorContains(t, err, "configuration: DATABASE_URL is required")
		}
		require.Equal(t, serve.Image, migrate.Image, "the Job migrates with the build the Deployment serves")
	})

	t.Run("ProbesAreTheServicesProbes", func(t *testing.T) {
		t.Parallel()
		for name, probe := range map[string]struct {
			probe *corev1.Probe
			path  string
		}{
			"liveness":  {serve.LivenessProbe, HealthzPath},
			"startup":   {serve.StartupProbe, HealthzPath},
			"readiness": {serve.ReadinessProbe, ReadyzPath},
		} {
			require.NotNil(t, probe.probe, name)
			require.NotNil(t, probe.probe.HTTPGet, "%s: an HTTP probe", name)
			require.Equal(t, probe.path, probe.probe.HTTPGet.Path, "%s probe's path", name)
		}
		// The paths are the probes' routes, not the status page's catch-all.
		mux := probes(&postgresCheck{}, nil, nil, prometheus.NewRegistry())
		for _, path := range []string{HealthzPath, ReadyzPath, MetricsPath} {
			_, pattern := mux.Handler(httptest.NewRequest(http.MethodGet, path, nil))
			require.Equal(t, "GET "+path, pattern)
		}
		// Liveness needs neither PostgreSQL nor RabbitMQ: an outage of either
		// restarts no pod.
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, serve.LivenessProbe.HTTPGet.Path, nil))
		require.Equal(t, http.StatusOK, rec.Code)
		// The readiness ping may take ReadyPingTimeout; a probe that gives up
		// sooner fails on a slow answer that would have been 200.
		require.Greater(t, time.Duration(serve.ReadinessProbe.TimeoutSeconds)*time.Second, ReadyPingTimeout)
	})

	t.Run("ProbesReachHTTPAddr", func(t *testing.T) {
		t.Parallel()
		// The port the pod listens on, from the HTTP_ADDR it gets: on every
		// interface, or the kubelet's probes find nothing.
		host, port, err := net.SplitHostPort(m.podEnv(t, serve)["HTTP_ADDR"])
		require.NoError(t, err, "HTTP_ADDR")
		require.True(t, host == "" || net.ParseIP(host).IsUnspecified(), "HTTP_ADDR listens on every interface, not %q", host)
		listens, err := strconv.Atoi(port)
		require.NoError(t, err)
		// The image alone listens there too (compose, a pod without the ConfigMap).
		imageHost, imagePort, err := net.SplitHostPort(m.image.env["HTTP_ADDR"])
		require.NoError(t, err, "the Dockerfile's ENV HTTP_ADDR")
		require.True(t, imageHost == "" || net.ParseIP(imageHost).IsUnspecified(), "the image listens on every interface, not %q", imageHost)
		require.Equal(t, port, imagePort)

		require.Len(t, m.service.Spec.Ports, 1)
		sp := m.service.Spec.Ports[0]
		servicePort := containerPort(t, serve, sp.TargetPort.StrVal, sp.TargetPort.IntVal)
		require.EqualValues(t, listens, servicePort, "the Service's targetPort is HTTP_ADDR's port")
		for _, probe := range []*corev1.Probe{serve.StartupProbe, serve.LivenessProbe, serve.ReadinessProbe} {
			require.True(t, probe != nil && probe.HTTPGet != nil, "three HTTP probes")
			got := probe.HTTPGet.Port
			require.EqualValues(t, listens, containerPort(t, serve, got.StrVal, got.IntVal), "the probe's port is HTTP_ADDR's port")
			if got.StrVal != "" {
				require.Equal(t, sp.TargetPort.StrVal, got.StrVal, "the probes name the Service's port")
			}
		}
		ann := m.service.Annotations
		require.Equal(t, "true", ann["prometheus.io/scrape"])
		require.Equal(t, port, ann["prometheus.io/port"])
		require.Equal(t, MetricsPath, ann["prometheus.io/path"])
	})

	t.Run("SettingsAreInboxds", func(t *testing.T) {
		t.Parallel()
		known := map[string]bool{}
		for _, s := range append((&config{}).settings(), otelSettings()...) {
			known[s.name] = true
		}
		for name, cm := range m.configMaps {
			for k := range cm.Data {
				require.True(t, known[k], "ConfigMap %s sets %s, which inboxd does not read", name, k)
			}
			require.Empty(t, cm.BinaryData, name)
		}
		for command, c := range map[string]corev1.Container{"migrate": migrate, "serve": serve} {
			for _, e := range c.Env {
				require.True(t, known[e.Name], "%s sets %s, which inboxd does not read", c.Name, e.Name)
			}
			// inboxd takes the pod's whole environment.
			env := m.podEnv(t, c)
			_, err := loadConfig(func(k string) string { return env[k] }, command)
			require.NoError(t, err, "%s: inboxd %s refuses its environment", c.Name, command)
		}
		env := m.podEnv(t, serve)
		cfg, err := loadConfig(func(k string) string { return env[k] }, "serve")
		require.NoError(t, err)
		require.False(t, cfg.migrate, "serve runs as inbox_service, which cannot migrate: INBOX_MIGRATE=false")
	})

	t.Run("SecretsByReference", func(t *testing.T) {
		t.Parallel()
		secret := map[string]bool{}
		for _, s := range (&config{}).settings() {
			secret[s.name] = s.secret
		}
		for name, cm := range m.configMaps {
			for k := range cm.Data {
				require.False(t, secret[k], "ConfigMap %s holds %s, a secret", name, k)
			}
		}
		example := map[[2]string]bool{}
		for _, s := range m.exampleSecrets {
			for k, v := range s.StringData {
				example[[2]string{s.Name, k}] = true
				require.Contains(t, v, "CHANGE-ME", "%s: the example holds placeholders only", s.Name)
			}
			require.Empty(t, s.Data, "%s: the example holds placeholders in stringData", s.Name)
		}
		refs := map[string]corev1.SecretKeySelector{}
		for _, c := range []corev1.Container{migrate, serve} {
			for _, e := range c.Env {
				if secret[e.Name] {
					require.Empty(t, e.Value, "%s: %s is a secret: by secretKeyRef, never inline", c.Name, e.Name)
					require.NotNil(t, e.ValueFrom, "%s: %s by secretKeyRef", c.Name, e.Name)
					require.NotNil(t, e.ValueFrom.SecretKeyRef, "%s: %s by secretKeyRef", c.Name, e.Name)
				}
				if e.ValueFrom != nil && e.ValueFrom.SecretKeyRef != nil {
					ref := *e.ValueFrom.SecretKeyRef
					require.True(t, example[[2]string{ref.Name, ref.Key}], "%s: %s reads key %s of Secret %s, which secrets.example.yaml does not show", c.Name, e.Name, ref.Key, ref.Name)
					refs[c.Name+" "+e.Name] = ref
				}
			}
		}
		// Serve and migrate log in as different roles: the owner's URL never
		// reaches the service.
		require.Contains(t, refs, "migrate DATABASE_URL")
		require.Contains(t, refs, "inboxd DATABASE_URL")
		require.Contains(t, refs, "inboxd AMQP_URL")
		require.NotEqual(t, refs["migrate DATABASE_URL"].Name, refs["inboxd DATABASE_URL"].Name, "the owner's and the service's DATABASE_URL come from different Secrets")
	})

	t.Run("PodsAreLockedDown", func(t *testing.T) {
		t.Parallel()
		require.NotEqual(t, int64(-1), m.image.uid, "the Dockerfile's image has a USER")
		for kind, spec := range pods {
			c := onlyContainer(t, spec)
			pod, sc := spec.SecurityContext, c.SecurityContext
			require.NotNil(t, pod, kind)
			require.NotNil(t, sc, kind)
			// The container's setting, else the pod's.
			runAsNonRoot := cmpOrPtr(sc.RunAsNonRoot, pod.RunAsNonRoot)
			runAsUser := cmpOrPtr(sc.RunAsUser, pod.RunAsUser)
			runAsGroup := cmpOrPtr(sc.RunAsGroup, pod.RunAsGroup)
			seccomp := cmpOrPtr(sc.SeccompProfile, pod.SeccompProfile)
			require.True(t, runAsNonRoot != nil && *runAsNonRoot, "%s: runAsNonRoot", kind)
			require.NotNil(t, runAsUser, "%s: runAsUser", kind)
			require.Equal(t, m.image.uid, *runAsUser, "%s: runs as the image's user", kind)
			require.NotNil(t, runAsGroup, "%s: runAsGroup", kind)
			require.Equal(t, m.image.gid, *runAsGroup, "%s: runs as the image's group", kind)
			require.NotNil(t, seccomp, "%s: seccompProfile", kind)
			require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, seccomp.Type, kind)
			require.True(t, sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem, "%s: readOnlyRootFilesystem", kind)
			require.True(t, sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation, "%s: allowPrivilegeEscalation false", kind)
			require.NotNil(t, sc.Capabilities, kind)
			require.Equal(t, []corev1.Capability{"ALL"}, sc.Capabilities.Drop, "%s: drops every capability", kind)
			require.Empty(t, sc.Capabilities.Add, kind)
			require.Nil(t, sc.Privileged, kind)
			require.True(t, spec.AutomountServiceAccountToken != nil && !*spec.AutomountServiceAccountToken, "%s: inboxd never calls the Kubernetes API", kind)
		}
	})

	t.Run("ResourcesFitTheService", func(t *testing.T) {
		t.Parallel()
		for kind, spec := range pods {
			r := onlyContainer(t, spec).Resources
			for _, name := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
				req, okReq := r.Requests[name]
				limit, okLimit := r.Limits[name]
				require.True(t, okReq && okLimit, "%s: requests and limits of %s", kind, name)
				require.LessOrEqual(t, req.Cmp(limit), 0, "%s: the %s request is within the limit", kind, name)
			}
		}
		// Go's soft memory limit, which serve sets unless GOMEMLIMIT is, is
		// under the container's: the collector works before the OOM killer.
		env := m.podEnv(t, serve)
		require.Empty(t, env["GOMEMLIMIT"], "GOMEMLIMIT is left to serve (this test reads the limit serve sets)")
		cfg, err := loadConfig(func(k string) string { return env[k] }, "serve")
		require.NoError(t, err)
		goLimit := resource.NewQuantity(int64(cfg.maxInflightBytes)+memoryHeadroom, resource.BinarySI)
		limit := serve.Resources.Limits[corev1.ResourceMemory]
		require.Equal(t, 1, limit.Cmp(*goLimit), "the memory limit (%s) is above Go's (%s)", limit.String(), goLimit.String())
	})

	t.Run("GraceCoversShutdown", func(t *testing.T) {
		t.Parallel()
		env := m.podEnv(t, serve)
		cfg, err := loadConfig(func(k string) string { return env[k] }, "serve")
		require.NoError(t, err)
		grace := m.deployment.Spec.Template.Spec.TerminationGracePeriodSeconds
		require.NotNil(t, grace)
		require.GreaterOrEqual(t, time.Duration(*grace)*time.Second, cfg.shutdownTimeout+SpanFlushTimeout,
			"terminationGracePeriodSeconds covers INBOX_SHUTDOWN_TIMEOUT and the spans' flush; past it the kubelet kills inboxd mid-shutdown")
	})

	t.Run("ReplicasAndBudget", func(t *testing.T) {
		t.Parallel()
		require.NotNil(t, m.deployment.Spec.Replicas)
		require.EqualValues(t, 2, *m.deployment.Spec.Replicas)
		require.NotNil(t, m.pdb.Spec.MinAvailable)
		require.Equal(t, 1, m.pdb.Spec.MinAvailable.IntValue())

		servePod := labels.Set(m.deployment.Spec.Template.Labels)
		migratePod := labels.Set(m.job.Spec.Template.Labels)
		for name, sel := range map[string]*metav1.LabelSelector{"Deployment": m.deployment.Spec.Selector, "PodDisruptionBudget": m.pdb.Spec.Selector} {
			s, err := metav1.LabelSelectorAsSelector(sel)
			require.NoError(t, err, name)
			require.True(t, s.Matches(servePod), "%s selects the Deployment's pods", name)
			require.False(t, s.Matches(migratePod), "%s leaves the migrate Job's pod alone", name)
		}
		s := labels.SelectorFromSet(m.service.Spec.Selector)
		require.True(t, s.Matches(servePod), "the Service selects the Deployment's pods")
		require.False(t, s.Matches(migratePod), "the Service leaves the migrate Job's pod alone")

		// docs/kubernetes.md applies the migrate step first with
		// -l 'app.kubernetes.io/component!=serve': the Job and what it
		// needs, not the service.
		first, err := labels.Parse("app.kubernetes.io/component!=serve")
		require.NoError(t, err)
		for _, obj := range m.resources {
			o, err := meta.Accessor(obj)
			require.NoError(t, err)
			isServe := slices.Contains([]runtime.Object{m.deployment, m.service, m.pdb}, obj)
			require.Equal(t, !isServe, first.Matches(labels.Set(o.GetLabels())), "%T %s in the migrate step", obj, o.GetName())
		}
	})
}

// cmpOrPtr returns the first of its pointers that is not nil.
func cmpOrPtr[T any](ps ...*T) *T {
	for _, p := range ps {
		if p != nil {
			return p
		}
	}
	return nil
}
