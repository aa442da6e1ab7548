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
USER nonroot:nonroot
EXPOSE 8080
ENTRYPOINT ["/usr/local/bin/inboxd"]
CMD ["serve"]
