# syntax=docker/dockerfile:1
# opgate's image: a build stage with the Rust toolchain (librdkafka is compiled from
# source by the rdkafka crate: it needs a C toolchain, perl, make, zlib and OpenSSL
# headers), then a small Debian runtime with the one binary, run as a non-root user.
#   docker build -t opgate .
#   docker run --rm opgate --version

FROM rust:1.88-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends libssl-dev zlib1g-dev perl make \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p opgate \
 && strip target/release/opgate

FROM debian:bookworm-slim AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libssl3 zlib1g \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 opgate \
 && useradd --system --uid 10001 --gid opgate --home-dir /var/lib/opgate --create-home opgate
COPY --from=build /src/target/release/opgate /usr/local/bin/opgate
COPY deploy/opgate.toml /etc/opgate/opgate.toml
USER 10001:10001
WORKDIR /var/lib/opgate
ENV OPGATE_CONFIG=/etc/opgate/opgate.toml
# 8080: admin API and console (api role); 9464: /metrics of the other roles; 9400: opgate sim.
EXPOSE 8080 9464 9400
ENTRYPOINT ["opgate"]
CMD ["--help"]
