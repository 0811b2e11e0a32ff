package main

import (
	"context"
	"database/sql"
	"path/filepath"
	"reflect"
	"unsafe"

	"devicehub/internal/history"
	"devicehub/internal/store"
)

// The store keeps its connections to itself: the server reaches the
// database only through the store's methods, and the compiler holds that.
// Tests read and write the database's state beside it, through the
// store's own connections, which these reach by reflection.

// storeField points at the unexported field name of st.
func storeField(st *store.Store, name string) reflect.Value {
	f := reflect.ValueOf(st).Elem().FieldByName(name)
	return reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem()
}

// storeWriter is st's writer: its one connection.
func storeWriter(st *store.Store) *sql.DB {
	return storeField(st, "writer").Interface().(*sql.DB)
}

// setStoreWriter makes db st's writer.
func setStoreWriter(st *store.Store, db *sql.DB) {
	storeField(st, "writer").Set(reflect.ValueOf(db))
}

// storeReader is st's pool of read-only connections.
func storeReader(st *store.Store) *sql.DB {
	return storeField(st, "reader").Elem().FieldByName("DB").Interface().(*sql.DB)
}

// storeEngine is st's history engine, which holds the open buckets, for
// tests that write history through history.Begin as the store does.
func storeEngine(st *store.Store) *history.Engine {
	return storeField(st, "engine").Interface().(*history.Engine)
}

// inTx runs fn in a transaction on st's writer and commits it.
func inTx(ctx context.Context, st *store.Store, fn func(tx *sql.Tx) error) error {
	tx, err := storeWriter(st).BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer tx.Rollback()
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}

// firmwareDir is the directory of st's firmware files.
func firmwareDir(st *store.Store) string {
	return storeField(st, "files").Elem().FieldByName("dir").String()
}

// firmwarePath is where st keeps the file with that sha256.
func firmwarePath(st *store.Store, sha256sum string) string {
	return filepath.Join(firmwareDir(st), sha256sum+".bin")
}

// storeBeside is a bare store on st's firmware directory whose writes go
// through db: what a removal needs of a CLI's store beside st, its
// firmware files' lock its own, as another process's is.
func storeBeside(st *store.Store, db *sql.DB) *store.Store {
	cli := &store.Store{}
	files := reflect.New(storeField(st, "files").Type().Elem())
	dir := files.Elem().FieldByName("dir")
	reflect.NewAt(dir.Type(), unsafe.Pointer(dir.UnsafeAddr())).Elem().SetString(firmwareDir(st))
	storeField(cli, "files").Set(files)
	setStoreWriter(cli, db)
	return cli
}
