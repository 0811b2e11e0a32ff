// Command ceiling is the load run's yardstick: a bare net/http server that
// answers each configured path with fixed bytes, with the same headers as
// devicehub. Whatever devicehub achieves is measured against it.
//
//	ceiling -addr 127.0.0.1:9090 /v1/auth/me=me.json /v1/user/devices=devices.json
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strconv"
	"strings"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:9090", "listen address")
	flag.Parse()
	mux := http.NewServeMux()
	for _, arg := range flag.Args() {
		path, file, ok := strings.Cut(arg, "=")
		if !ok {
			log.Fatalf("argument %q: want PATH=FILE", arg)
		}
		body, err := os.ReadFile(file)
		if err != nil {
			log.Fatal(err)
		}
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			h := w.Header()
			h.Set("Content-Type", "application/json")
			h.Set("X-Content-Type-Options", "nosniff")
			h.Set("Content-Length", strconv.Itoa(len(body)))
			w.Write(body)
		})
	}
	fmt.Println("ceiling listening on", *addr)
	log.Fatal(http.ListenAndServe(*addr, mux))
}
