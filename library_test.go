package main

import (
	"bytes"
	"devicehub/internal/store"
	"fmt"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// uploadToLibrary sends a firmware upload into u's team library.
func (e *testEnv) uploadToLibrary(u testUser, fields map[string]string, file []byte) *httptest.ResponseRecorder {
	body, ct := multipartForm(fields, file)
	return e.serve(e.t, newRequest("POST", "/v1/user/firmwares", "Bearer "+u.token, ct, bytes.NewReader(body)))
}

// apiLibraryJSON is a library entry as the API renders it; by is
// `{"id":…,"name":…}` or null.
func apiLibraryJSON(name, version, sha, md5sum, size, by, createdAt string, running, targeting int) string {
	return fmt.Sprintf(`{"sha256":%q,"md5":%q,"name":%s,"version":%s,"notes":null,"platform":null,"size":%s,"uploaded_by":%s,"created_at":%q,"devices_running":%d,"devices_targeting":%d}`,
		sha, md5sum, apiJSON(name), version, size, by, createdAt, running, targeting)
}

// TestFirmwareLibraryAPI: GET, POST and DELETE /v1/user/firmwares, and
// rollouts of a library file. Alice's team has "lib" in its library and
// "dev" on her device (its target), uploaded a second later; Bob's has
// "bobs" in its library.
func TestFirmwareLibraryAPI(t *testing.T) {
	t.Parallel()
	libBytes, devBytes, bobBytes := []byte("\xe9library build"), []byte("\xe9device build"), []byte("\xe9bob's build")
	newBytes := []byte("\xe9a new build")
	fixture := func(t *testing.T, env *testEnv, v apiVars) {
		if w := env.uploadToLibrary(env.alice, map[string]string{"name": "lib", "version": "2.0"}, libBytes); w.Code != 201 {
			t.Fatalf("library upload: %d %s", w.Code, w.Body)
		}
		env.clock.advance(time.Second)
		v["later"] = env.clock.now().UTC().Format(store.TimeFormat)
		apiUpload(env, env.alice, "dev", devBytes)
		env.setTarget(env.alice, md5Hex(devBytes))
		if w := env.uploadToLibrary(env.bob, map[string]string{"name": "bobs"}, bobBytes); w.Code != 201 {
			t.Fatalf("library upload: %d %s", w.Code, w.Body)
		}
		for name, b := range map[string][]byte{"lib": libBytes, "dev": devBytes, "bobs": bobBytes, "new": newBytes} {
			v[name+"_md5"], v[name+"_sha"], v[name+"_size"] = md5Hex(b), sha256Hex(b), strconv.Itoa(len(b))
		}
	}
	alice := `{"id":{alice_id},"name":"Alice"}`
	lib := func(running int) string {
		return apiLibraryJSON("lib", `"2.0"`, "{lib_sha}", "{lib_md5}", "{lib_size}", alice, "{now}", running, 0)
	}
	dev := apiLibraryJSON("dev", "null", "{dev_sha}", "{dev_md5}", "{dev_size}", "null", "{later}", 0, 1)
	libraryRows := func(want string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			wantDB(t, env.st, v.expand(want), `SELECT coalesce(group_concat(l.name || ' ' || l.sha256 || ' ' || coalesce(l.uploaded_by, '-'), '; '), '')
				FROM (SELECT * FROM library_firmwares ORDER BY id) l JOIN users u ON u.team_id = l.team_id WHERE u.id = ?`, v["alice_id"])
		}
	}
	deviceRows := func(want string) checkFunc {
		return func(t *testing.T, env *testEnv, v apiVars, w *httptest.ResponseRecorder) {
			t.Helper()
			wantDB(t, env.st, v.expand(want), `SELECT group_concat(f.name || ' ' || coalesce(f.version, '-') || ' ' || f.md5
				|| ' ' || (f.id IS d.target_firmware_id), '; ') FROM (SELECT * FROM firmwares ORDER BY id) f
				JOIN devices d ON d.id = f.device_id WHERE d.uid = ?`, v["alice"])
		}
	}
	upload := func(name string, form map[string]string, file []byte, setup setupFunc, wantStatus int, wantBody string, check checkFunc) apiCase {
		return apiCase{name: name, setup: setup, method: "POST", path: "/v1/user/firmwares", token: "{alice_token}", form: form, file: file,
			wantStatus: wantStatus, wantBody: wantBody, check: check}
	}
	fieldErr := func(field, msg string) string { return apiFieldError(field, "The "+field+" field "+msg) }
	deleted := `{"message":"Firmware deleted."}`
	notFound := `{"message":"Firmware not found."}`

	tests := []apiCase{
		call("list", "GET", "/v1/user/firmwares", "{alice_token}", "", 200, `{"data":[`+dev+`,`+lib(0)+`]}`),
		call("list as bob", "GET", "/v1/user/firmwares", "{bob_token}", "", 200,
			`{"data":[`+apiLibraryJSON("bobs", "null", "{bobs_sha}", "{bobs_md5}", "{bobs_size}", `{"id":{bob_id},"name":"Bob"}`, "{later}", 0, 0)+`]}`),
		call("list counts the devices running a file", "GET", "/v1/user/firmwares", "{alice_token}", "", 200, `{"data":[`+dev+`,`+lib(1)+`]}`).
			after(func(t *testing.T, env *testEnv, v apiVars) {
				mustExec(t, env.st, `UPDATE devices SET current_md5 = ? WHERE uid = ?`, v["lib_md5"], v["alice"])
			}),
		call("a file both in the library and on a device is one entry", "GET", "/v1/user/firmwares", "{alice_token}", "", 200,
			`{"data":[`+dev+`,`+lib(0)+`]}`).after(func(t *testing.T, env *testEnv, v apiVars) { apiUpload(env, env.alice, "copy", libBytes) }),

		upload("upload", map[string]string{"name": "new", "version": "3.0"}, newBytes, nil, 201,
			`{"data":`+apiLibraryJSON("new", `"3.0"`, "{new_sha}", "{new_md5}", "{new_size}", alice, "{later}", 0, 0)+`}`,
			libraryRows("lib {lib_sha} {alice_id}; new {new_sha} {alice_id}")),
		upload("upload any file without a platform", map[string]string{"name": "plain"}, []byte("not an image"), nil, 201, "",
			libraryRows("lib {lib_sha} {alice_id}; plain "+sha256Hex([]byte("not an image"))+" {alice_id}")),
		upload("upload an image for an esp platform", map[string]string{"name": "new", "version": "3.0", "platform": "esp32"}, newBytes, nil, 201,
			`{"data":`+strings.Replace(apiLibraryJSON("new", `"3.0"`, "{new_sha}", "{new_md5}", "{new_size}", alice, "{later}", 0, 0),
				`"platform":null`, `"platform":"esp32"`, 1)+`}`, nil),
		upload("upload a non-image for an esp platform", map[string]string{"name": "plain", "platform": "esp32"}, []byte("not an image"), nil,
			422, fieldErr("file", "must be an ESP application image: a .bin whose first byte is 0xE9 (on an ESP8266 also a .bin.gz)."), nil),
		upload("upload a file the library has", map[string]string{"name": "again"}, libBytes, nil,
			422, fieldErr("file", "is already in the firmware library."), nil),
		upload("upload a file a device has", map[string]string{"name": "kept"}, devBytes, nil, 201, "",
			libraryRows("lib {lib_sha} {alice_id}; kept {dev_sha} {alice_id}")),
		upload("upload past the team's storage", map[string]string{"name": "big"}, bytes.Repeat([]byte{0xe9}, 1<<20),
			func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withQuotas(store.Quotas{FirmwareMiB: 1})) }, 422, `{"message":"This upload would pass your team's firmware storage limit of 1 MiB."}`, nil),
		{name: "a device's upload counts the library's files", method: "POST", path: "/v1/user/devices/{alice}/firmwares", token: "{alice_token}",
			form: map[string]string{"name": "half"}, file: bytes.Repeat([]byte{0xe9, 1}, 300<<10),
			setup: func(t *testing.T, env *testEnv, v apiVars) {
				if w := env.uploadToLibrary(env.alice, map[string]string{"name": "half"}, bytes.Repeat([]byte{0xe9, 2}, 300<<10)); w.Code != 201 {
					t.Fatalf("library upload: %d %s", w.Code, w.Body)
				}
				env.rebuild(withQuotas(store.Quotas{FirmwareMiB: 1}))
			},
			wantStatus: 422, wantBody: `{"message":"This upload would pass your team's firmware storage limit of 1 MiB."}`},
		upload("upload past the library's files", map[string]string{"name": "one more"}, newBytes,
			func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withQuotas(store.Quotas{LibraryFiles: 1})) }, 422,
			`{"message":"Your team's firmware library has reached its limit of 1 files. Delete a file first."}`, libraryRows("lib {lib_sha} {alice_id}")),
		upload("upload within the library's files", map[string]string{"name": "one more"}, newBytes,
			func(t *testing.T, env *testEnv, v apiVars) { env.rebuild(withQuotas(store.Quotas{LibraryFiles: 2})) }, 201, "",
			libraryRows("lib {lib_sha} {alice_id}; one more {new_sha} {alice_id}")),
		// The team holds 2 small files (4 KiB blocks on disk) and 254 of 6
		// bytes: 256 blocks, 1 MiB. Counted by bytes, they were 1.5 KiB.
		upload("upload past the team's storage in disk blocks", map[string]string{"name": "tiny"}, newBytes,
			func(t *testing.T, env *testEnv, v apiVars) {
				env.rebuild(withQuotas(store.Quotas{FirmwareMiB: 1}))
				for i := range 254 {
					file := fmt.Appendf(nil, "\xe9%05d", i)
					must(t, os.WriteFile(firmwarePath(env.st, sha256Hex(file)), file, 0o600))
					mustExec(t, env.st, `INSERT INTO library_firmwares (team_id, name, md5, sha256, size, created_at)
						SELECT team_id, 'tiny', ?2, ?3, ?4, ?5 FROM users WHERE id = ?1`,
						v["alice_id"], md5Hex(file), sha256Hex(file), len(file), apiNow)
				}
			}, 422, `{"message":"This upload would pass your team's firmware storage limit of 1 MiB."}`, nil),
		upload("upload without a name", map[string]string{}, newBytes, nil, 422, fieldErr("name", "is required."), nil),

		call("delete", "DELETE", "/v1/user/firmwares/{lib_sha}", "{alice_token}", "", 200, deleted).then(libraryRows("")),
		call("delete in upper case", "DELETE", "/v1/user/firmwares/{lib_SHA}", "{alice_token}", "", 200, deleted).
			after(func(t *testing.T, env *testEnv, v apiVars) { v["lib_SHA"] = strings.ToUpper(v["lib_sha"]) }),
		call("delete a file a device has", "DELETE", "/v1/user/firmwares/{dev_sha}", "{alice_token}", "", 422,
			`{"message":"Cannot delete firmware while a device has it; delete it from the device first."}`),
		call("delete another team's file", "DELETE", "/v1/user/firmwares/{bobs_sha}", "{alice_token}", "", 404, notFound),
		call("delete a malformed sha256", "DELETE", "/v1/user/firmwares/xyz", "{alice_token}", "", 404, notFound),
		call("a device's firmware deleted keeps the library's file", "DELETE", "/v1/user/devices/{alice}/firmwares/{lib_md5}", "{alice_token}", "",
			200, deleted).after(func(t *testing.T, env *testEnv, v apiVars) { apiUpload(env, env.alice, "copy", libBytes) }).
			then(libraryRows("lib {lib_sha} {alice_id}")),

		// The device gets a row for the file; no broker, so it is sent
		// nothing and keeps its target.
		call("a rollout of a library file", "POST", "/v1/user/rollouts", "{alice_token}", `{"md5":"{lib_md5}","device_uids":["{alice}"]}`, 201, "").
			then(deviceRows("dev - {dev_md5} 1; lib 2.0 {lib_md5} 0")),
		call("a rollout of an esp8266 file to an esp32", "POST", "/v1/user/rollouts", "{alice_token}",
			`{"md5":"{new_md5}","device_uids":["{alice}"]}`, 422,
			apiFieldError("md5", "The md5 field names firmware for another platform than some of the devices.")).
			after(func(t *testing.T, env *testEnv, v apiVars) {
				if w := env.uploadToLibrary(env.alice, map[string]string{"name": "8266", "platform": "esp8266"}, newBytes); w.Code != 201 {
					t.Fatalf("library upload: %d %s", w.Code, w.Body)
				}
			}),
		call("a rollout of another team's library file", "POST", "/v1/user/rollouts", "{alice_token}",
			`{"md5":"{bobs_md5}","device_uids":["{alice}"]}`, 422,
			apiFieldError("md5", "The md5 field must be the md5 of one of your firmwares.")),
	}
	runAPICases(t, fixture, tests)
}
