#!/usr/bin/env sh
# A local CA and certificates for testing TLS (never for production): writes into DIR (default
# infra/nats/certs) ca.pem, server.pem/server-key.pem (for nats-1..3, localhost, 127.0.0.1) and
# client.pem/client-key.pem (for mutual TLS). Needs openssl.
set -eu
DIR="${1:-$(dirname "$0")/certs}"
DAYS="${DAYS:-365}"
mkdir -p "$DIR"
cd "$DIR"
umask 077

openssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" -subj "/CN=gpuherd dev CA" \
  -keyout ca-key.pem -out ca.pem 2>/dev/null

issue() {  # name, common name, extensions
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$2" -keyout "$1-key.pem" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial -days "$DAYS" \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

issue server "nats" "subjectAltName=DNS:nats-1,DNS:nats-2,DNS:nats-3,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth,clientAuth"
issue client "gpuherd client" "extendedKeyUsage=clientAuth"
chmod 644 ca.pem server.pem client.pem
echo "CA and certificates in $DIR"
