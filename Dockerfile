# syntax=docker/dockerfile:1

# Build: a static inboxd binary.
FROM golang:1.26-bookworm AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# VERSION names the build in the attempt history and in inboxd_build_info,
# e.g. docker build --build-arg VERSION=$(git describe --always --dirty) .
ARG VERSION=""
RUN CGO_ENABLED=0 go build -trimpath -ldflags="-s -w -X main.version=${VERSION}" -o /out/inboxd ./cmd/inboxd

# Run: no shell, no package manager, not root.
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/inboxd /usr/local/bin/inboxd
# The binary listens on loopback by default; in a container the probes and
# scrapes come from outside it (the kubelet, Prometheus, compose's port), so
# the image listens on every interface. `inboxd healthcheck` asks :8080 on
# 127.0.0.1. Keep the port off the public network.
ENV HTTP_ADDR=:8080
# The image's nonroot user (65532), by number: Kubernetes' runAsNonRoot can
# verify a number, not a name (deploy/kubernetes runs as 65532 too).
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/inboxd"]
CMD ["serve"]
