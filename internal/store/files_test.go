package store

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// fileFuncs are the functions of the store that may call package os
// besides firmwareFiles' methods: the database file's mode (the one file
// of the store that is not firmware), firmwareFiles' constructor and the
// helpers of files.go.
var fileFuncs = []string{"createOwnerOnly", "openFirmwareFiles", "SyncDir", "removeFiles"}

// TestOnlyFirmwareFilesTouchFiles: in the store's product files, only
// firmwareFiles' methods and fileFuncs call package os, so that a
// firmware file is made, moved, opened or removed only through
// firmwareFiles (files.go). The compiler cannot say that; this check
// does, over the syntax.
func TestOnlyFirmwareFilesTouchFiles(t *testing.T) {
	names, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range names {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range osCallsOutsideFiles(t, name, src) {
			t.Errorf("%s: %s", name, v)
		}
	}
	// The check catches a call where it must not be.
	bad := []byte("package store\nimport \"os\"\nfunc (s *Store) drop(p string) { os.Remove(p) }\n" +
		"func (ff *firmwareFiles) drop(p string) { os.Remove(p) }\n")
	if got := osCallsOutsideFiles(t, "bad.go", bad); len(got) != 1 {
		t.Errorf("a Store method that calls os.Remove: got %q, want it named once", got)
	}
}

// osCallsOutsideFiles names the calls of package os in src outside
// firmwareFiles' methods and fileFuncs.
func osCallsOutsideFiles(t *testing.T, name string, src []byte) []string {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), name, src, parser.SkipObjectResolution)
	if err != nil {
		t.Fatal(err)
	}
	var found []string
	for _, decl := range f.Decls {
		fn, ok := decl.(*ast.FuncDecl)
		if !ok || fn.Body == nil || isFirmwareFilesMethod(fn) || (fn.Recv == nil && slices.Contains(fileFuncs, fn.Name.Name)) {
			continue
		}
		ast.Inspect(fn.Body, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			if sel, ok := call.Fun.(*ast.SelectorExpr); ok {
				if pkg, ok := sel.X.(*ast.Ident); ok && pkg.Name == "os" {
					found = append(found, fn.Name.Name+" calls os."+sel.Sel.Name)
				}
			}
			return true
		})
	}
	return found
}

func isFirmwareFilesMethod(fn *ast.FuncDecl) bool {
	if fn.Recv == nil || len(fn.Recv.List) != 1 {
		return false
	}
	star, ok := fn.Recv.List[0].Type.(*ast.StarExpr)
	if !ok {
		return false
	}
	id, ok := star.X.(*ast.Ident)
	return ok && id.Name == "firmwareFiles"
}
